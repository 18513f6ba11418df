#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cloudevents::Event;
use serde_json::json;
use sluice_functions::{CesqlFilter, CesqlValue, EvalError, RuleIndex};

fn ev() -> Event {
    common::event(
        json!({"x": 1}),
        json!({
            "sequence": "10",
            "hop": 3,
            "ttl": 7,
            "flag": true,
            "name": "Francesco",
            "word": "  padded  ",
            "big": 9_000_000_000_i64,
            "truthy": "TRUE",
            "subject": "Grüße",
        }),
    )
}

use CesqlValue::{Boolean as B, Integer as I, String as S};

fn eval(expr: &str) -> (CesqlValue, Vec<EvalError>) {
    let f = CesqlFilter::parse(expr).unwrap_or_else(|e| panic!("{expr}: {e}"));
    let r = f.evaluate(&ev());
    (r.value, r.errors)
}

fn ok(cases: &[(&str, CesqlValue)]) {
    for (expr, expected) in cases {
        let (v, errs) = eval(expr);
        assert_eq!(&v, expected, "{expr}");
        assert!(errs.is_empty(), "{expr}: unexpected errors {errs:?}");
    }
}

/// Value plus the number of errors raised.
fn errs(cases: &[(&str, CesqlValue, usize)]) {
    for (expr, expected, n) in cases {
        let (v, errs) = eval(expr);
        assert_eq!(&v, expected, "{expr}");
        assert_eq!(errs.len(), *n, "{expr}: {errs:?}");
    }
}

#[test]
fn literals_and_attributes() {
    ok(&[
        ("true", B(true)),
        ("FaLsE", B(false)),
        ("42", I(42)),
        ("-42", I(-42)),
        ("2147483647", I(i32::MAX)),
        ("-2147483648", I(i32::MIN)),
        (r"'it\'s'", S("it's".into())),
        (r#""say \"hi\"""#, S("say \"hi\"".into())),
        ("\"single ' inside\"", S("single ' inside".into())),
        ("id", S("e-1".into())),
        ("type", S("com.example.order.created".into())),
        ("source", S("/orders/eu".into())),
        ("specversion", S("1.0".into())),
        ("datacontenttype", S("application/json".into())),
        ("time", S("2024-05-01T10:00:00Z".into())),
        ("hop", I(3)),
        ("flag", B(true)),
        ("sequence", S("10".into())),
        // Beyond 32 bits an integer extension is kept as its string form.
        ("big", S("9000000000".into())),
    ]);
}

#[test]
fn missing_attribute_is_false_with_error() {
    errs(&[
        ("missing", B(false), 1),
        ("missing = 'x'", B(false), 1),
        ("true AND (missing = '')", B(false), 1),
        // Guarded by EXISTS and short-circuit: no error.
        ("EXISTS missing AND missing = 'x'", B(false), 0),
        ("NOT EXISTS missing OR missing = 'x'", B(true), 0),
    ]);
    // Missing propagates: every operator receiving it yields its zero value.
    let f = CesqlFilter::parse("NOT (missing = 'x')").unwrap();
    let r = f.evaluate(&ev());
    assert_eq!(r.value, B(false));
    assert_eq!(
        r.errors,
        vec![EvalError::MissingAttribute("missing".into())]
    );
    assert!(!f.matches(&ev()), "errors make a filter fail");
}

#[test]
fn logic_operators() {
    ok(&[
        ("true AND false", B(false)),
        ("true OR false", B(true)),
        ("true XOR true", B(false)),
        ("true XOR false", B(true)),
        ("NOT true", B(false)),
        ("NOT NOT true", B(true)),
        ("false AND missing", B(false)),
        ("true OR missing", B(true)),
        ("'true' AND 'TRUE'", B(true)),
        ("truthy AND flag", B(true)),
        // One precedence level, left to right.
        ("true OR false AND false", B(false)),
        ("true OR (false AND false)", B(true)),
    ]);
    errs(&[
        ("1 AND true", B(false), 1),
        ("'yes' OR false", B(false), 1),
        ("NOT 'maybe'", B(true), 1),
        ("false XOR missing", B(false), 1),
    ]);
}

#[test]
fn comparisons_and_coercion() {
    ok(&[
        ("sequence = 10", B(true)),
        ("sequence = '10'", B(true)),
        ("10 = sequence", B(true)),
        ("hop < ttl", B(true)),
        ("hop <= 3", B(true)),
        ("hop > 3", B(false)),
        ("hop >= 3", B(true)),
        ("hop != 3", B(false)),
        ("hop <> 4", B(true)),
        ("name = 'Francesco'", B(true)),
        ("name != 'francesco'", B(true)),
        ("flag = true", B(true)),
        ("flag = 'true'", B(true)),
        ("truthy = true", B(true)),
        ("3 = '3'", B(true)),
        ("flag = 1", B(true)),
        ("1 + true", I(2)),
        ("'3' < 4", B(true)),
        ("'TRUE' = true", B(true)),
        // The right operand's type decides: true becomes 'true' here.
        ("true = 'TRUE'", B(false)),
        ("1 = 1 = true", B(true)),
    ]);
    errs(&[
        ("name = 3", B(false), 1),
        // A failed cast yields the zero value and the operator goes on.
        ("name < 3", B(true), 1),
        ("hop = true", B(false), 1),
    ]);
}

#[test]
fn arithmetic() {
    ok(&[
        ("1 + 2 * 3", I(7)),
        ("(1 + 2) * 3", I(9)),
        ("7 / 2", I(3)),
        ("-7 / 2", I(-3)),
        ("7 % 3", I(1)),
        ("-7 % 3", I(-1)),
        ("7 % -3", I(1)),
        ("10 - 2 - 3", I(5)),
        ("- hop", I(-3)),
        ("-(-3)", I(3)),
        ("sequence + 1", I(11)),
        ("hop * ttl = 21", B(true)),
    ]);
    errs(&[
        ("1 / 0", I(0), 1),
        ("1 % 0", I(0), 1),
        ("2147483647 + 1", I(0), 1),
        ("-2147483648 - 1", I(0), 1),
        ("- (-2147483648)", I(i32::MAX), 1),
        ("name + 1", I(1), 1),
    ]);
}

#[test]
fn like_in_exists() {
    ok(&[
        ("name LIKE 'Fran%'", B(true)),
        ("name LIKE 'fran%'", B(false)),
        ("name LIKE '%cesco'", B(true)),
        ("name LIKE 'F_ancesco'", B(true)),
        ("name LIKE 'F_ncesco'", B(false)),
        ("name LIKE '%'", B(true)),
        ("name NOT LIKE 'X%'", B(true)),
        ("'abc%' LIKE 'abc\\%'", B(true)),
        ("'abcd' LIKE 'abc\\%'", B(false)),
        ("'a_c' LIKE 'a\\_c'", B(true)),
        ("'abc' LIKE 'a\\_c'", B(false)),
        ("'ab' LIKE '_b%'", B(true)),
        ("'b' LIKE '_b%'", B(false)),
        ("subject LIKE 'Gr__e'", B(true)),
        ("hop LIKE '3'", B(true)),
        ("'' LIKE ''", B(true)),
        ("'aaa' LIKE '%a%a%a%'", B(true)),
        ("'aa' LIKE '%a%a%a%'", B(false)),
        ("hop IN (1, 2, 3)", B(true)),
        ("hop IN ('3', 'x')", B(true)),
        ("hop NOT IN (1, 2)", B(true)),
        ("name IN ('a', 'Francesco')", B(true)),
        ("sequence IN (10, 11)", B(true)),
        ("EXISTS id", B(true)),
        ("EXISTS subject", B(true)),
        ("EXISTS dataschema", B(false)),
        ("EXISTS hop", B(true)),
        ("exists nope", B(false)),
    ]);
    errs(&[
        ("hop IN ('x', 3)", B(true), 1),
        ("hop IN (3, 'x')", B(true), 0),
    ]);
}

#[test]
fn string_functions() {
    ok(&[
        ("LENGTH(name)", I(9)),
        ("LENGTH(subject)", I(5)),
        ("length('')", I(0)),
        ("CONCAT()", S(String::new())),
        ("CONCAT('a', 1, true)", S("a1true".into())),
        ("CONCAT_WS('-', 'a', 'b', 'c')", S("a-b-c".into())),
        ("CONCAT_WS('-')", S(String::new())),
        ("LOWER('ÀB')", S("àb".into())),
        ("UPPER(subject)", S("GRÜSSE".into())),
        ("TRIM(word)", S("padded".into())),
        ("LEFT('abc', 2)", S("ab".into())),
        ("LEFT('abc', 5)", S("abc".into())),
        ("RIGHT('abc', 2)", S("bc".into())),
        ("RIGHT('abc', 0)", S(String::new())),
        ("SUBSTRING('abcdef', 3)", S("cdef".into())),
        ("SUBSTRING('abcdef', -2)", S("ef".into())),
        ("SUBSTRING('abcdef', 0)", S(String::new())),
        ("SUBSTRING('abcdef', 2, 3)", S("bcd".into())),
        ("SUBSTRING('abcdef', 5, 10)", S("ef".into())),
        ("SUBSTRING('abcdef', -3, 2)", S("de".into())),
        ("SUBSTRING('abcdef', 6)", S("f".into())),
        ("SUBSTRING('Grüße', 3, 2)", S("üß".into())),
    ]);
    errs(&[
        ("LEFT('abc', -1)", S("abc".into()), 1),
        ("RIGHT('abc', -1)", S("abc".into()), 1),
        ("SUBSTRING('abc', 4)", S(String::new()), 1),
        ("SUBSTRING('abc', -4)", S(String::new()), 1),
        ("SUBSTRING('abc', 1, -1)", S(String::new()), 1),
        ("LEFT('abc', 'x')", S(String::new()), 1),
    ]);
}

#[test]
fn math_and_cast_functions() {
    ok(&[
        ("ABS(-5)", I(5)),
        ("ABS(5)", I(5)),
        ("INT('42')", I(42)),
        ("INT('-7')", I(-7)),
        ("INT(sequence) + 1", I(11)),
        ("BOOL('true')", B(true)),
        ("BOOL('False')", B(false)),
        ("STRING(42)", S("42".into())),
        ("STRING(true)", S("true".into())),
        ("IS_INT('12')", B(true)),
        ("IS_INT('1.5')", B(false)),
        ("IS_INT(12)", B(true)),
        ("IS_INT(true)", B(false)),
        ("IS_BOOL('TRUE')", B(true)),
        ("IS_BOOL('yes')", B(false)),
        ("IS_BOOL(false)", B(true)),
        ("INT(true)", I(1)),
        ("BOOL(1)", B(true)),
        ("BOOL(0)", B(false)),
        ("BOOL(-50)", B(true)),
        ("is_int(hop)", B(true)),
    ]);
    errs(&[
        ("ABS(-2147483648)", I(i32::MAX), 1),
        ("INT('x')", I(0), 1),
        ("INT('99999999999')", I(0), 1),
        ("BOOL('x')", B(false), 1),
    ]);
}

#[test]
fn filter_matching() {
    let e = ev();
    let yes = [
        "type = 'com.example.order.created'",
        "hop < ttl AND name LIKE 'F%'",
        "EXISTS subject",
    ];
    let no = ["type = 'x'", "'abc'", "1", "hop / 0 = 0", "missing = 'x'"];
    for f in yes {
        assert!(CesqlFilter::parse(f).unwrap().matches(&e), "{f}");
    }
    for f in no {
        assert!(!CesqlFilter::parse(f).unwrap().matches(&e), "{f}");
    }
    let mut b = RuleIndex::builder();
    for (i, f) in yes.iter().chain(no.iter()).enumerate() {
        b.add_filter(i, CesqlFilter::parse(f).unwrap());
    }
    let mut out = Vec::new();
    b.build().matches(&e, &mut out);
    assert_eq!(out, vec![0, 1, 2]);
}

#[test]
fn syntax_errors_name_position_and_expectation() {
    let cases = [
        ("", 1, "expected an expression"),
        ("type =", 7, "expected an expression"),
        ("(1 + 2", 7, "expected `)`"),
        ("type = 'x' foo", 12, "expected an operator or the end"),
        ("'abc", 1, "unterminated string"),
        ("Type = 'x'", 1, "not a valid attribute name"),
        ("NOPE(1)", 1, "unknown function"),
        ("LENGTH(1, 2)", 1, "does not take 2"),
        ("SUBSTRING('a')", 1, "does not take 1"),
        ("name LIKE 3", 11, "string literal after LIKE"),
        ("hop IN 3", 8, "`(` starting the IN set"),
        ("hop IN (1 2)", 11, "`,` or `)`"),
        ("2147483648", 1, "out of the 32-bit range"),
        ("a ! b", 3, "`!=`"),
        ("a # b", 3, "unexpected character"),
        ("EXISTS 'x'", 8, "attribute name after EXISTS"),
        ("hop NOT 3", 9, "LIKE or IN after NOT"),
        ("AND true", 1, "expected an expression"),
        ("12abc", 3, "operator after the integer"),
    ];
    for (src, pos, msg) in cases {
        let e = CesqlFilter::parse(src).expect_err(src);
        assert_eq!(e.position, pos, "{src}: {e}");
        assert!(e.message.contains(msg), "{src}: {e}");
    }
}

#[test]
fn nesting_is_bounded_but_long_chains_are_fine() {
    let deep = format!("{}true{}", "(".repeat(200), ")".repeat(200));
    let e = CesqlFilter::parse(&deep).unwrap_err();
    assert!(e.message.contains("deeper"), "{e}");
    let nots = format!("{}true", "NOT ".repeat(500));
    assert!(CesqlFilter::parse(&nots).is_err());
    let chain = vec!["hop = 3"; 5000].join(" OR ");
    let f = CesqlFilter::parse(&chain).unwrap();
    assert!(f.matches(&ev()));
    let likes = format!("name{}", " LIKE '%'".repeat(500));
    assert!(CesqlFilter::parse(&likes).is_err());
}

/// Cases from the CloudEvents CESQL v1 TCK (cesql/cesql_tck), converted by hand:
/// (expression, result, error kind or "").
#[test]
fn conformance_tck_cases() {
    fn kind(e: &EvalError) -> &'static str {
        match e {
            EvalError::Cast { .. } => "cast",
            EvalError::MissingAttribute(_) => "missingAttribute",
            EvalError::DivisionByZero | EvalError::Overflow(_) => "math",
            EvalError::Function { .. } => "functionEvaluation",
        }
    }
    let cases: &[(&str, CesqlValue, &str)] = &[
        ("FALSE AND FALSE", B(false), ""),
        ("TRUE AND TRUE", B(true), ""),
        ("false and (1 != 1 / 0)", B(false), ""),
        ("true and (1 != 1 / 0)", B(false), "math"),
        ("true or (1 != 1 / 0)", B(true), ""),
        ("false or (1 != 1 / 0)", B(false), "math"),
        ("TRUE XOR TRUE", B(false), ""),
        ("FALSE XOR TRUE", B(true), ""),
        ("missing = 2", B(false), "missingAttribute"),
        ("missing != 2", B(false), "missingAttribute"),
        ("missing <> 2", B(false), "missingAttribute"),
        ("missing <= 2", B(false), "missingAttribute"),
        ("true = 'TRUE'", B(false), ""),
        ("'TRUE' = true", B(true), ""),
        ("'abc' <> 'abc'", B(false), ""),
        ("4 * 2 + 4 / 2", I(10), ""),
        ("4 * (2 + 4) / 2", I(12), ""),
        ("5 / 3", I(1), ""),
        ("5 / 0", I(0), "math"),
        ("5 % 0", I(0), "math"),
        ("missing / 0", I(0), "missingAttribute"),
        ("missing % 0", I(0), "missingAttribute"),
        ("-4 + -1", I(-5), ""),
        ("'5' + 3", I(8), ""),
        ("5 + '3'", I(8), ""),
        ("'5' + '3'", I(8), ""),
        ("5 + TRUE", I(6), ""),
        ("INT('1')", I(1), ""),
        ("INT(TRUE)", I(1), ""),
        ("INT(FALSE)", I(0), ""),
        ("INT('ABC')", I(0), "cast"),
        ("BOOL('TRUE')", B(true), ""),
        ("BOOL(\"false\")", B(false), ""),
        ("BOOL('ABC')", B(false), "cast"),
        ("BOOL(100)", B(true), ""),
        ("STRING(FALSE)", S("false".into()), ""),
        ("STRING(-1)", S("-1".into()), ""),
        ("ABS(-2147483648)", I(i32::MAX), "math"),
        (r"'ab\c' LIKE 'ab\c'", B(true), ""),
        ("'abc' NOT LIKE 'abc'", B(false), ""),
        ("'azzzbzzzc' LIKE 'a%b%c'", B(true), ""),
        ("'' LIKE 'abc'", B(false), ""),
        ("'.ab.cde.' LIKE '.%.%.'", B(true), ""),
        ("'ab.cde' LIKE '.%.%.'", B(false), ""),
        ("'abc' LIKE 'a_b_c'", B(false), ""),
        ("'azbzc' LIKE 'a_b_c'", B(true), ""),
        (r"'a_b_c' LIKE 'a\_b\_c'", B(true), ""),
        (r"'azbzc' LIKE 'a\_b\_c'", B(false), ""),
        (r"'a%b%c' LIKE 'a\%b\%c'", B(true), ""),
        ("234 LIKE '23_'", B(true), ""),
        ("2344 LIKE '23_'", B(false), ""),
        ("TRUE LIKE 'tr%'", B(true), ""),
        ("FALSE LIKE 'fal%'", B(true), ""),
        (r#"'a"b\'c'"#, S("a\"b'c".into()), ""),
        (r#""a'b\"c""#, S("a'b\"c".into()), ""),
        ("--10", I(10), ""),
        ("-'10'", I(-10), ""),
        ("--'10'", I(10), ""),
        ("-TRUE", I(-1), ""),
        ("-missing", I(0), "missingAttribute"),
        ("NOT 'TRUE'", B(false), ""),
        ("NOT 10", B(true), "cast"),
        ("NOT missing", B(false), "missingAttribute"),
        ("LENGTH(TRUE)", I(4), ""),
        ("CONCAT_WS(',', 'a')", S("a".into()), ""),
        ("TRIM('   a b c')", S("a b c".into()), ""),
        ("LEFT('', 0)", S(String::new()), ""),
        ("LEFT('abc', -2)", S("abc".into()), "functionEvaluation"),
        ("RIGHT('abc', -2)", S("abc".into()), "functionEvaluation"),
        ("SUBSTRING('Quadratically', 5)", S("ratically".into()), ""),
        ("SUBSTRING('Sakila', -3)", S("ila".into()), ""),
        ("SUBSTRING('abcdef', 2, 4)", S("bcde".into()), ""),
        ("SUBSTRING('Sakila', -5, 3)", S("aki".into()), ""),
        ("SUBSTRING('Quadratically', 0, 1)", S(String::new()), ""),
        (
            "SUBSTRING('abcdef', 10, 10)",
            S(String::new()),
            "functionEvaluation",
        ),
        (
            "SUBSTRING('abcdef', -10, 10)",
            S(String::new()),
            "functionEvaluation",
        ),
        ("(TRUE)", B(true), ""),
        ("4 * (2 + 3)", I(20), ""),
        ("myext LIKE 'custom%'", B(false), "missingAttribute"),
        (
            "type LIKE 'com.%' AND myext LIKE 'custom%'",
            B(false),
            "missingAttribute",
        ),
    ];
    for (expr, value, error) in cases {
        let (v, errs) = eval(expr);
        assert_eq!(&v, value, "{expr}");
        let kinds: Vec<&str> = errs.iter().map(kind).collect();
        if error.is_empty() {
            assert!(kinds.is_empty(), "{expr}: {errs:?}");
        } else {
            assert_eq!(kinds, vec![*error], "{expr}");
        }
    }
    // CONCAT_WS() cannot be dispatched: rejected when parsing.
    assert!(CesqlFilter::parse("CONCAT_WS()").is_err());
}
