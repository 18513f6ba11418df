//! CloudEvents SQL (CESQL) v1 filters: a hand-written lexer and recursive-descent parser
//! and a total evaluator that returns a value together with the list of errors raised.
//!
//! Precedence, loosest first: `AND`/`OR`/`XOR` (one level, left to right); comparisons;
//! `+ -`; `* / %`; `LIKE`/`IN` (postfix); unary `NOT`/`-`. This follows the precedence of
//! the official ANTLR grammar, so `NOT a = b` reads `(NOT a) = b`; write `NOT (a = b)`.
//! Binary chains are stored flat, and nesting (parentheses, unary operators, function
//! arguments, postfix operators) is bounded by [`MAX_CESQL_DEPTH`], so hostile input can
//! neither overflow the stack at parse nor at evaluation time.

use std::fmt;

use cloudevents::event::AttributeValue;
use cloudevents::Event;

use crate::view::{attribute_value, time_string};

/// Deepest nesting an expression may have.
pub const MAX_CESQL_DEPTH: usize = 64;

/// A CESQL expression that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CESQL syntax error at position {position}: {message}")]
pub struct CesqlError {
    /// 1-based character position in the expression.
    pub position: usize,
    /// What was found and what was expected.
    pub message: String,
}

/// A CESQL value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CesqlValue {
    Boolean(bool),
    Integer(i32),
    String(String),
}

impl fmt::Display for CesqlValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CesqlValue::Boolean(b) => write!(f, "{b}"),
            CesqlValue::Integer(i) => write!(f, "{i}"),
            CesqlValue::String(s) => f.write_str(s),
        }
    }
}

impl CesqlValue {
    fn type_name(&self) -> &'static str {
        match self {
            CesqlValue::Boolean(_) => "Boolean",
            CesqlValue::Integer(_) => "Integer",
            CesqlValue::String(_) => "String",
        }
    }
}

/// An error raised while evaluating; evaluation still yields a value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    #[error("cannot cast {from} `{value}` to {to}")]
    Cast {
        from: &'static str,
        to: &'static str,
        value: String,
    },
    #[error("missing attribute `{0}`")]
    MissingAttribute(String),
    #[error("division by zero")]
    DivisionByZero,
    #[error("integer overflow in {0}")]
    Overflow(&'static str),
    #[error("{function}: {message}")]
    Function {
        function: &'static str,
        message: String,
    },
}

/// The result of evaluating an expression: always a value, plus any errors raised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    pub value: CesqlValue,
    pub errors: Vec<EvalError>,
}

/// A parsed CESQL filter.
#[derive(Debug, Clone)]
pub struct CesqlFilter {
    source: String,
    expr: Expr,
}

impl CesqlFilter {
    /// Parses an expression.
    pub fn parse(source: &str) -> Result<CesqlFilter, CesqlError> {
        let tokens = lex(source)?;
        let mut p = Parser {
            tokens,
            pos: 0,
            depth: 0,
        };
        let expr = p.expression()?;
        if let Some(t) = p.peek_token() {
            return Err(p.error_at(
                t,
                format!("expected an operator or the end, found {}", t.kind),
            ));
        }
        Ok(CesqlFilter {
            source: source.to_owned(),
            expr,
        })
    }

    /// The expression text this filter was parsed from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates the expression in complete-evaluation mode.
    pub fn evaluate(&self, event: &Event) -> Evaluation {
        let mut errors = Vec::new();
        let value = eval(&self.expr, event, &mut errors);
        Evaluation { value, errors }
    }

    /// True only when the expression evaluates to `true` without any error (as the CESQL
    /// spec requires of filters).
    pub fn matches(&self, event: &Event) -> bool {
        let ev = self.evaluate(event);
        ev.errors.is_empty() && ev.value == CesqlValue::Boolean(true)
    }
}

// ---------------------------------------------------------------- lexer

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Int(u64),
    Str(String),
    Word(String),
    LParen,
    RParen,
    Comma,
    Op(&'static str),
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::Int(i) => write!(f, "integer `{i}`"),
            Kind::Str(s) => write!(f, "string '{s}'"),
            Kind::Word(w) => write!(f, "`{w}`"),
            Kind::LParen => f.write_str("`(`"),
            Kind::RParen => f.write_str("`)`"),
            Kind::Comma => f.write_str("`,`"),
            Kind::Op(o) => write!(f, "`{o}`"),
        }
    }
}

#[derive(Debug, Clone)]
struct Token {
    kind: Kind,
    /// 1-based character position.
    pos: usize,
}

fn lex(src: &str) -> Result<Vec<Token>, CesqlError> {
    let chars: Vec<char> = src.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied();
    while let Some(c) = at(i) {
        let pos = i + 1;
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        let simple = match c {
            '(' => Some(Kind::LParen),
            ')' => Some(Kind::RParen),
            ',' => Some(Kind::Comma),
            '+' => Some(Kind::Op("+")),
            '-' => Some(Kind::Op("-")),
            '*' => Some(Kind::Op("*")),
            '/' => Some(Kind::Op("/")),
            '%' => Some(Kind::Op("%")),
            '=' => Some(Kind::Op("=")),
            _ => None,
        };
        if let Some(kind) = simple {
            tokens.push(Token { kind, pos });
            i += 1;
            continue;
        }
        match c {
            '<' | '>' | '!' => {
                let two = at(i + 1);
                let (op, len) = match (c, two) {
                    ('<', Some('=')) => ("<=", 2),
                    ('<', Some('>')) => ("<>", 2),
                    ('>', Some('=')) => (">=", 2),
                    ('!', Some('=')) => ("!=", 2),
                    ('<', _) => ("<", 1),
                    ('>', _) => (">", 1),
                    _ => {
                        return Err(CesqlError {
                            position: pos,
                            message: "expected `!=` after `!`".into(),
                        })
                    }
                };
                tokens.push(Token {
                    kind: Kind::Op(op),
                    pos,
                });
                i += len;
            }
            '\'' | '"' => {
                let quote = c;
                let mut s = String::new();
                i += 1;
                loop {
                    match at(i) {
                        None => {
                            return Err(CesqlError {
                                position: pos,
                                message: format!("unterminated string literal, expected {quote}"),
                            })
                        }
                        Some('\\') if at(i + 1) == Some(quote) => {
                            s.push(quote);
                            i += 2;
                        }
                        Some(ch) if ch == quote => {
                            i += 1;
                            break;
                        }
                        Some(ch) => {
                            s.push(ch);
                            i += 1;
                        }
                    }
                }
                tokens.push(Token {
                    kind: Kind::Str(s),
                    pos,
                });
            }
            d if d.is_ascii_digit() => {
                let mut n: u64 = 0;
                while let Some(d) = at(i).and_then(|c| c.to_digit(10)) {
                    n = n.saturating_mul(10).saturating_add(u64::from(d));
                    i += 1;
                }
                if at(i).is_some_and(|c| c.is_alphabetic() || c == '_') {
                    return Err(CesqlError {
                        position: i + 1,
                        message: "expected an operator after the integer literal".into(),
                    });
                }
                tokens.push(Token {
                    kind: Kind::Int(n),
                    pos,
                });
            }
            w if w.is_ascii_alphabetic() || w == '_' => {
                let mut word = String::new();
                while let Some(c) = at(i).filter(|c| c.is_ascii_alphanumeric() || *c == '_') {
                    word.push(c);
                    i += 1;
                }
                tokens.push(Token {
                    kind: Kind::Word(word),
                    pos,
                });
            }
            other => {
                return Err(CesqlError {
                    position: pos,
                    message: format!("unexpected character `{other}`"),
                })
            }
        }
    }
    Ok(tokens)
}

// ---------------------------------------------------------------- syntax tree

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BinOp {
    And,
    Or,
    Xor,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Add,
    Sub,
    Mul,
    Div,
    Mod,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Func {
    Length,
    Concat,
    ConcatWs,
    Lower,
    Upper,
    Trim,
    Left,
    Right,
    Substring,
    Abs,
    Int,
    Bool,
    String,
    IsInt,
    IsBool,
}

impl Func {
    fn lookup(name: &str, arity: usize) -> Result<Func, String> {
        let upper = name.to_ascii_uppercase();
        let (f, ok) = match upper.as_str() {
            "LENGTH" => (Func::Length, arity == 1),
            "CONCAT" => (Func::Concat, true),
            "CONCAT_WS" => (Func::ConcatWs, arity >= 1),
            "LOWER" => (Func::Lower, arity == 1),
            "UPPER" => (Func::Upper, arity == 1),
            "TRIM" => (Func::Trim, arity == 1),
            "LEFT" => (Func::Left, arity == 2),
            "RIGHT" => (Func::Right, arity == 2),
            "SUBSTRING" => (Func::Substring, arity == 2 || arity == 3),
            "ABS" => (Func::Abs, arity == 1),
            "INT" => (Func::Int, arity == 1),
            "BOOL" => (Func::Bool, arity == 1),
            "STRING" => (Func::String, arity == 1),
            "IS_INT" => (Func::IsInt, arity == 1),
            "IS_BOOL" => (Func::IsBool, arity == 1),
            _ => return Err(format!("unknown function `{name}`")),
        };
        if ok {
            Ok(f)
        } else {
            Err(format!(
                "function `{upper}` does not take {arity} argument(s)"
            ))
        }
    }

    fn name(self) -> &'static str {
        match self {
            Func::Length => "LENGTH",
            Func::Concat => "CONCAT",
            Func::ConcatWs => "CONCAT_WS",
            Func::Lower => "LOWER",
            Func::Upper => "UPPER",
            Func::Trim => "TRIM",
            Func::Left => "LEFT",
            Func::Right => "RIGHT",
            Func::Substring => "SUBSTRING",
            Func::Abs => "ABS",
            Func::Int => "INT",
            Func::Bool => "BOOL",
            Func::String => "STRING",
            Func::IsInt => "IS_INT",
            Func::IsBool => "IS_BOOL",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LikePart {
    Lit(char),
    One,
    Many,
}

#[derive(Debug, Clone)]
enum Expr {
    Lit(CesqlValue),
    Attr(String),
    Exists(String),
    Not(Box<Expr>),
    Neg(Box<Expr>),
    /// A left-associative chain: `first op1 e1 op2 e2 ...`.
    Chain(Box<Expr>, Vec<(BinOp, Expr)>),
    Like {
        value: Box<Expr>,
        pattern: Vec<LikePart>,
        negated: bool,
    },
    In {
        value: Box<Expr>,
        set: Vec<Expr>,
        negated: bool,
    },
    Call(Func, Vec<Expr>),
}

// ---------------------------------------------------------------- parser

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    depth: usize,
}

fn keyword(t: &Token) -> Option<String> {
    match &t.kind {
        Kind::Word(w) => Some(w.to_ascii_uppercase()),
        _ => None,
    }
}

const KEYWORDS: [&str; 9] = [
    "AND", "OR", "XOR", "NOT", "LIKE", "IN", "EXISTS", "TRUE", "FALSE",
];

impl Parser {
    fn peek_token(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn peek_kw(&self) -> Option<String> {
        self.peek_token().and_then(keyword)
    }

    fn peek_op(&self) -> Option<&'static str> {
        match self.peek_token().map(|t| &t.kind) {
            Some(Kind::Op(o)) => Some(o),
            _ => None,
        }
    }

    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.pos).cloned();
        if t.is_some() {
            self.pos += 1;
        }
        t
    }

    fn end_position(&self) -> usize {
        self.tokens.last().map_or(1, |t| t.pos + 1)
    }

    fn error_at(&self, t: &Token, message: String) -> CesqlError {
        CesqlError {
            position: t.pos,
            message,
        }
    }

    fn error_here(&self, expected: &str) -> CesqlError {
        match self.peek_token() {
            Some(t) => self.error_at(t, format!("expected {expected}, found {}", t.kind)),
            None => CesqlError {
                position: self.end_position(),
                message: format!("expected {expected}, found the end of the expression"),
            },
        }
    }

    fn enter(&mut self) -> Result<(), CesqlError> {
        self.depth += 1;
        if self.depth > MAX_CESQL_DEPTH {
            let position = self.peek_token().map_or(self.end_position(), |t| t.pos);
            return Err(CesqlError {
                position,
                message: format!("expression nests deeper than {MAX_CESQL_DEPTH} levels"),
            });
        }
        Ok(())
    }

    fn expression(&mut self) -> Result<Expr, CesqlError> {
        self.enter()?;
        let r = self.logic();
        self.depth -= 1;
        r
    }

    fn chain(
        &mut self,
        next: fn(&mut Self) -> Result<Expr, CesqlError>,
        op: fn(&Self) -> Option<BinOp>,
    ) -> Result<Expr, CesqlError> {
        let first = next(self)?;
        let mut rest = Vec::new();
        while let Some(o) = op(self) {
            self.pos += 1;
            rest.push((o, next(self)?));
        }
        Ok(if rest.is_empty() {
            first
        } else {
            Expr::Chain(Box::new(first), rest)
        })
    }

    fn logic(&mut self) -> Result<Expr, CesqlError> {
        self.chain(Self::comparison, |p| match p.peek_kw().as_deref() {
            Some("AND") => Some(BinOp::And),
            Some("OR") => Some(BinOp::Or),
            Some("XOR") => Some(BinOp::Xor),
            _ => None,
        })
    }

    fn comparison(&mut self) -> Result<Expr, CesqlError> {
        self.chain(Self::additive, |p| match p.peek_op() {
            Some("=") => Some(BinOp::Eq),
            Some("!=") | Some("<>") => Some(BinOp::Ne),
            Some("<") => Some(BinOp::Lt),
            Some("<=") => Some(BinOp::Le),
            Some(">") => Some(BinOp::Gt),
            Some(">=") => Some(BinOp::Ge),
            _ => None,
        })
    }

    fn additive(&mut self) -> Result<Expr, CesqlError> {
        self.chain(Self::multiplicative, |p| match p.peek_op() {
            Some("+") => Some(BinOp::Add),
            Some("-") => Some(BinOp::Sub),
            _ => None,
        })
    }

    fn multiplicative(&mut self) -> Result<Expr, CesqlError> {
        self.chain(Self::postfix, |p| match p.peek_op() {
            Some("*") => Some(BinOp::Mul),
            Some("/") => Some(BinOp::Div),
            Some("%") => Some(BinOp::Mod),
            _ => None,
        })
    }

    fn postfix(&mut self) -> Result<Expr, CesqlError> {
        let mut e = self.unary()?;
        let entered = self.depth;
        loop {
            let save = self.pos;
            let mut negated = false;
            if self.peek_kw().as_deref() == Some("NOT") {
                negated = true;
                self.pos += 1;
            }
            match self.peek_kw().as_deref() {
                Some("LIKE") => {
                    self.enter()?;
                    self.pos += 1;
                    let pattern = match self.next() {
                        Some(Token {
                            kind: Kind::Str(s), ..
                        }) => like_pattern(&s),
                        _ => {
                            self.pos -= 1;
                            return Err(self.error_here("a string literal after LIKE"));
                        }
                    };
                    e = Expr::Like {
                        value: Box::new(e),
                        pattern,
                        negated,
                    };
                }
                Some("IN") => {
                    self.enter()?;
                    self.pos += 1;
                    let set = self.set()?;
                    e = Expr::In {
                        value: Box::new(e),
                        set,
                        negated,
                    };
                }
                _ => {
                    if negated {
                        self.pos = save;
                        return Err(self.error_here_after_not());
                    }
                    break;
                }
            }
        }
        self.depth = entered;
        Ok(e)
    }

    fn error_here_after_not(&mut self) -> CesqlError {
        self.pos += 1;
        self.error_here("LIKE or IN after NOT")
    }

    fn set(&mut self) -> Result<Vec<Expr>, CesqlError> {
        match self.next() {
            Some(Token {
                kind: Kind::LParen, ..
            }) => {}
            _ => {
                self.pos = self.pos.saturating_sub(1);
                return Err(self.error_here("`(` starting the IN set"));
            }
        }
        let mut items = vec![self.expression()?];
        loop {
            match self.next().map(|t| t.kind) {
                Some(Kind::Comma) => items.push(self.expression()?),
                Some(Kind::RParen) => return Ok(items),
                Some(_) => {
                    self.pos -= 1;
                    return Err(self.error_here("`,` or `)` in the IN set"));
                }
                None => return Err(self.error_here("`,` or `)` in the IN set")),
            }
        }
    }

    fn unary(&mut self) -> Result<Expr, CesqlError> {
        if self.peek_kw().as_deref() == Some("NOT") {
            self.pos += 1;
            self.enter()?;
            let inner = self.unary()?;
            self.depth -= 1;
            return Ok(Expr::Not(Box::new(inner)));
        }
        if self.peek_op() == Some("-") {
            self.pos += 1;
            if let Some(Kind::Int(n)) = self.peek_token().map(|t| t.kind.clone()) {
                if n <= 2_147_483_648 {
                    self.pos += 1;
                    let v = -(n as i64);
                    return Ok(Expr::Lit(CesqlValue::Integer(v as i32)));
                }
            }
            self.enter()?;
            let inner = self.unary()?;
            self.depth -= 1;
            return Ok(Expr::Neg(Box::new(inner)));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, CesqlError> {
        let Some(t) = self.next() else {
            return Err(self.error_here("an expression"));
        };
        match t.kind.clone() {
            Kind::Int(n) => {
                if let Ok(i) = i32::try_from(n) {
                    Ok(Expr::Lit(CesqlValue::Integer(i)))
                } else {
                    Err(self.error_at(&t, "integer literal out of the 32-bit range".into()))
                }
            }
            Kind::Str(s) => Ok(Expr::Lit(CesqlValue::String(s))),
            Kind::LParen => {
                let e = self.expression()?;
                match self.next() {
                    Some(Token {
                        kind: Kind::RParen, ..
                    }) => Ok(e),
                    Some(_) => {
                        self.pos -= 1;
                        Err(self.error_here("`)`"))
                    }
                    None => Err(self.error_here("`)`")),
                }
            }
            Kind::Word(w) => self.word(&t, w),
            _ => {
                self.pos -= 1;
                Err(self.error_here("an expression"))
            }
        }
    }

    fn word(&mut self, t: &Token, w: String) -> Result<Expr, CesqlError> {
        let upper = w.to_ascii_uppercase();
        if matches!(self.peek_token().map(|t| &t.kind), Some(Kind::LParen))
            && !KEYWORDS.contains(&upper.as_str())
        {
            self.pos += 1;
            self.enter()?;
            let mut args = Vec::new();
            if !matches!(self.peek_token().map(|t| &t.kind), Some(Kind::RParen)) {
                args.push(self.expression()?);
                while matches!(self.peek_token().map(|t| &t.kind), Some(Kind::Comma)) {
                    self.pos += 1;
                    args.push(self.expression()?);
                }
            }
            match self.next().map(|t| t.kind) {
                Some(Kind::RParen) => {}
                Some(_) => {
                    self.pos -= 1;
                    return Err(self.error_here("`,` or `)` in the argument list"));
                }
                None => return Err(self.error_here("`)` closing the argument list")),
            }
            self.depth -= 1;
            let f = Func::lookup(&w, args.len()).map_err(|m| self.error_at(t, m))?;
            return Ok(Expr::Call(f, args));
        }
        match upper.as_str() {
            "TRUE" => Ok(Expr::Lit(CesqlValue::Boolean(true))),
            "FALSE" => Ok(Expr::Lit(CesqlValue::Boolean(false))),
            "EXISTS" => match self.next() {
                Some(Token {
                    kind: Kind::Word(name),
                    pos,
                }) if is_identifier(&name)
                    && !KEYWORDS.contains(&name.to_ascii_uppercase().as_str()) =>
                {
                    let _ = pos;
                    Ok(Expr::Exists(name))
                }
                Some(_) => {
                    self.pos -= 1;
                    Err(self.error_here("an attribute name after EXISTS"))
                }
                None => Err(self.error_here("an attribute name after EXISTS")),
            },
            "AND" | "OR" | "XOR" | "NOT" | "LIKE" | "IN" => {
                self.pos -= 1;
                Err(self.error_here("an expression"))
            }
            _ if is_identifier(&w) => Ok(Expr::Attr(w)),
            _ => Err(self.error_at(
                t,
                format!(
                    "`{w}` is not a valid attribute name (lowercase letters and digits) nor a \
                     function call"
                ),
            )),
        }
    }
}

fn is_identifier(w: &str) -> bool {
    !w.is_empty()
        && w.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

fn like_pattern(s: &str) -> Vec<LikePart> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.peek() {
                Some(&e @ ('%' | '_' | '\\')) => {
                    chars.next();
                    out.push(LikePart::Lit(e));
                }
                _ => out.push(LikePart::Lit('\\')),
            },
            '%' => {
                if out.last() != Some(&LikePart::Many) {
                    out.push(LikePart::Many);
                }
            }
            '_' => out.push(LikePart::One),
            other => out.push(LikePart::Lit(other)),
        }
    }
    out
}

fn like_matches(pattern: &[LikePart], s: &str) -> bool {
    let text: Vec<char> = s.chars().collect();
    let (mut p, mut t) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match (pattern.get(p), text.get(t)) {
            (Some(LikePart::Many), _) => {
                star = Some((p, t));
                p += 1;
            }
            (Some(LikePart::One), Some(_)) => {
                p += 1;
                t += 1;
            }
            (Some(LikePart::Lit(c)), Some(x)) if c == x => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern
        .get(p..)
        .is_some_and(|rest| rest.iter().all(|x| *x == LikePart::Many))
}

// ---------------------------------------------------------------- evaluation
//
// Semantics follow the spec and its TCK:
// - A failed implicit cast records a cast error and yields the zero value of the target
//   type (0, false, ""); the operator then proceeds (`NOT 10` is `true` plus an error).
// - Boolean casts to Integer as 1/0; Integer does not cast to Boolean implicitly (BOOL(x)
//   does, as x != 0); everything casts to String.
// - Errors propagate: an operator or function whose operand raised any error (a missing
//   attribute, a division by zero, a failed cast inside it...) yields the zero value of its
//   own return type without computing (`missing / 0` is 0 with only the missing-attribute
//   error; `true AND (1 != 1 / 0)` is false). Only the casts an operator applies to its
//   own operands let it go on.

/// A value plus whether an error was raised while computing it.
struct Ev {
    value: CesqlValue,
    failed: bool,
}

impl Ev {
    fn of(value: CesqlValue) -> Ev {
        Ev {
            value,
            failed: false,
        }
    }

    fn failed(zero: CesqlValue) -> Ev {
        Ev {
            value: zero,
            failed: true,
        }
    }
}

const ZERO_BOOL: CesqlValue = CesqlValue::Boolean(false);
const ZERO_INT: CesqlValue = CesqlValue::Integer(0);

fn zero_string() -> CesqlValue {
    CesqlValue::String(String::new())
}

fn attribute(event: &Event, name: &str) -> Option<CesqlValue> {
    Some(match attribute_value(event, name)? {
        AttributeValue::Boolean(b) => CesqlValue::Boolean(*b),
        AttributeValue::Integer(i) => match i32::try_from(*i) {
            Ok(i) => CesqlValue::Integer(i),
            Err(_) => CesqlValue::String(i.to_string()),
        },
        AttributeValue::Time(t) => CesqlValue::String(time_string(t)),
        other => CesqlValue::String(other.to_string()),
    })
}

fn cast_error(v: &CesqlValue, to: &'static str) -> EvalError {
    EvalError::Cast {
        from: v.type_name(),
        to,
        value: v.to_string(),
    }
}

fn parse_int(s: &str) -> Option<i32> {
    s.trim().parse::<i32>().ok()
}

fn parse_bool(s: &str) -> Option<bool> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("true") {
        Some(true)
    } else if s.eq_ignore_ascii_case("false") {
        Some(false)
    } else {
        None
    }
}

fn to_int(v: CesqlValue, errors: &mut Vec<EvalError>) -> i32 {
    match v {
        CesqlValue::Integer(i) => i,
        CesqlValue::Boolean(b) => i32::from(b),
        CesqlValue::String(ref s) => parse_int(s).unwrap_or_else(|| {
            errors.push(cast_error(&v, "Integer"));
            0
        }),
    }
}

fn to_bool(v: CesqlValue, errors: &mut Vec<EvalError>) -> bool {
    match v {
        CesqlValue::Boolean(b) => b,
        CesqlValue::String(ref s) => parse_bool(s).unwrap_or_else(|| {
            errors.push(cast_error(&v, "Boolean"));
            false
        }),
        CesqlValue::Integer(_) => {
            errors.push(cast_error(&v, "Boolean"));
            false
        }
    }
}

fn to_string(v: CesqlValue) -> String {
    match v {
        CesqlValue::String(s) => s,
        other => other.to_string(),
    }
}

/// Casts `v` to the type of `like`.
fn cast_like(v: CesqlValue, like: &CesqlValue, errors: &mut Vec<EvalError>) -> CesqlValue {
    match like {
        CesqlValue::Boolean(_) => CesqlValue::Boolean(to_bool(v, errors)),
        CesqlValue::Integer(_) => CesqlValue::Integer(to_int(v, errors)),
        CesqlValue::String(_) => CesqlValue::String(to_string(v)),
    }
}

fn eval(e: &Expr, event: &Event, errors: &mut Vec<EvalError>) -> CesqlValue {
    eval_ev(e, event, errors).value
}

fn eval_ev(e: &Expr, event: &Event, errors: &mut Vec<EvalError>) -> Ev {
    let before = errors.len();
    let mut ev = eval_node(e, event, errors);
    if errors.len() > before {
        ev.failed = true;
    }
    ev
}

fn eval_node(e: &Expr, event: &Event, errors: &mut Vec<EvalError>) -> Ev {
    match e {
        Expr::Lit(v) => Ev::of(v.clone()),
        Expr::Attr(name) => match attribute(event, name) {
            Some(v) => Ev::of(v),
            None => {
                errors.push(EvalError::MissingAttribute(name.clone()));
                Ev::failed(ZERO_BOOL)
            }
        },
        Expr::Exists(name) => Ev::of(CesqlValue::Boolean(attribute_value(event, name).is_some())),
        Expr::Not(inner) => {
            let v = eval_ev(inner, event, errors);
            if v.failed {
                return Ev::failed(ZERO_BOOL);
            }
            Ev::of(CesqlValue::Boolean(!to_bool(v.value, errors)))
        }
        Expr::Neg(inner) => {
            let v = eval_ev(inner, event, errors);
            if v.failed {
                return Ev::failed(ZERO_INT);
            }
            let i = to_int(v.value, errors);
            Ev::of(CesqlValue::Integer(i.checked_neg().unwrap_or_else(|| {
                errors.push(EvalError::Overflow("unary minus"));
                i32::MAX
            })))
        }
        Expr::Chain(first, rest) => {
            let mut acc = eval_ev(first, event, errors);
            for (op, rhs) in rest {
                acc = if acc.failed {
                    Ev::failed(zero_of(*op))
                } else {
                    binary(*op, acc.value, rhs, event, errors)
                };
            }
            acc
        }
        Expr::Like {
            value,
            pattern,
            negated,
        } => {
            let v = eval_ev(value, event, errors);
            if v.failed {
                return Ev::failed(ZERO_BOOL);
            }
            let s = to_string(v.value);
            Ev::of(CesqlValue::Boolean(like_matches(pattern, &s) != *negated))
        }
        Expr::In {
            value,
            set,
            negated,
        } => {
            let x = eval_ev(value, event, errors);
            if x.failed {
                return Ev::failed(ZERO_BOOL);
            }
            let mut found = false;
            for item in set {
                let v = eval_ev(item, event, errors);
                if v.failed {
                    return Ev::failed(ZERO_BOOL);
                }
                if cast_like(v.value, &x.value, errors) == x.value {
                    found = true;
                    break;
                }
            }
            Ev::of(CesqlValue::Boolean(found != *negated))
        }
        Expr::Call(f, args) => call(*f, args, event, errors),
    }
}

fn zero_of(op: BinOp) -> CesqlValue {
    match op {
        BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div | BinOp::Mod => ZERO_INT,
        _ => ZERO_BOOL,
    }
}

/// One step of a chain; `left` is known not to have failed.
fn binary(
    op: BinOp,
    left: CesqlValue,
    right: &Expr,
    event: &Event,
    errors: &mut Vec<EvalError>,
) -> Ev {
    if matches!(op, BinOp::And | BinOp::Or) {
        let l = to_bool(left, errors);
        // Short-circuit: the right operand is not evaluated (and raises no errors).
        if (op == BinOp::And && !l) || (op == BinOp::Or && l) {
            return Ev::of(CesqlValue::Boolean(l));
        }
        let r = eval_ev(right, event, errors);
        if r.failed {
            return Ev::failed(ZERO_BOOL);
        }
        return Ev::of(CesqlValue::Boolean(to_bool(r.value, errors)));
    }
    let r = eval_ev(right, event, errors);
    if r.failed {
        return Ev::failed(zero_of(op));
    }
    let r = r.value;
    Ev::of(match op {
        BinOp::Xor => {
            let l = to_bool(left, errors);
            CesqlValue::Boolean(l != to_bool(r, errors))
        }
        BinOp::Eq | BinOp::Ne => {
            let l = cast_like(left, &r, errors);
            CesqlValue::Boolean((l == r) == (op == BinOp::Eq))
        }
        _ => {
            let l = to_int(left, errors);
            let r = to_int(r, errors);
            arithmetic(op, l, r, errors)
        }
    })
}

fn arithmetic(op: BinOp, l: i32, r: i32, errors: &mut Vec<EvalError>) -> CesqlValue {
    let checked = |v: Option<i32>, what: &'static str, errors: &mut Vec<EvalError>| {
        CesqlValue::Integer(v.unwrap_or_else(|| {
            errors.push(EvalError::Overflow(what));
            0
        }))
    };
    match op {
        BinOp::Lt => CesqlValue::Boolean(l < r),
        BinOp::Le => CesqlValue::Boolean(l <= r),
        BinOp::Gt => CesqlValue::Boolean(l > r),
        BinOp::Ge => CesqlValue::Boolean(l >= r),
        BinOp::Add => checked(l.checked_add(r), "+", errors),
        BinOp::Sub => checked(l.checked_sub(r), "-", errors),
        BinOp::Mul => checked(l.checked_mul(r), "*", errors),
        BinOp::Div | BinOp::Mod if r == 0 => {
            errors.push(EvalError::DivisionByZero);
            CesqlValue::Integer(0)
        }
        BinOp::Div => checked(l.checked_div(r), "/", errors),
        BinOp::Mod => checked(l.checked_rem(r), "%", errors),
        // Logic and equality are handled by the caller.
        _ => CesqlValue::Boolean(false),
    }
}

impl Func {
    fn zero(self) -> CesqlValue {
        match self {
            Func::Length | Func::Abs | Func::Int => ZERO_INT,
            Func::Bool | Func::IsInt | Func::IsBool => ZERO_BOOL,
            _ => zero_string(),
        }
    }
}

fn call(f: Func, args: &[Expr], event: &Event, errors: &mut Vec<EvalError>) -> Ev {
    let mut vals = Vec::with_capacity(args.len());
    for a in args {
        let v = eval_ev(a, event, errors);
        if v.failed {
            return Ev::failed(f.zero());
        }
        vals.push(v.value);
    }
    let mut vals = vals.into_iter();
    let mut next = || vals.next().unwrap_or_else(zero_string);
    let fail = |errors: &mut Vec<EvalError>, message: String| {
        errors.push(EvalError::Function {
            function: f.name(),
            message,
        })
    };
    Ev::of(match f {
        Func::Length => {
            let n = to_string(next()).chars().count();
            CesqlValue::Integer(i32::try_from(n).unwrap_or(i32::MAX))
        }
        Func::Concat => {
            let mut s = String::new();
            for _ in 0..args.len() {
                s.push_str(&to_string(next()));
            }
            CesqlValue::String(s)
        }
        Func::ConcatWs => {
            let sep = to_string(next());
            let parts: Vec<String> = (1..args.len()).map(|_| to_string(next())).collect();
            CesqlValue::String(parts.join(&sep))
        }
        Func::Lower => CesqlValue::String(to_string(next()).to_lowercase()),
        Func::Upper => CesqlValue::String(to_string(next()).to_uppercase()),
        Func::Trim => CesqlValue::String(to_string(next()).trim().to_owned()),
        Func::Left | Func::Right => {
            let s = to_string(next());
            let n = to_int(next(), errors);
            if n < 0 {
                fail(errors, format!("negative length {n}"));
                return Ev::of(CesqlValue::String(s));
            }
            let len = s.chars().count();
            let n = (n as usize).min(len);
            let out: String = if f == Func::Left {
                s.chars().take(n).collect()
            } else {
                s.chars().skip(len - n).collect()
            };
            CesqlValue::String(out)
        }
        Func::Substring => {
            let s = to_string(next());
            let pos = to_int(next(), errors);
            let take = if args.len() == 3 {
                Some(to_int(next(), errors))
            } else {
                None
            };
            substring(&s, pos, take)
                .map(CesqlValue::String)
                .unwrap_or_else(|m| {
                    fail(errors, m);
                    zero_string()
                })
        }
        Func::Abs => {
            let i = to_int(next(), errors);
            CesqlValue::Integer(i.checked_abs().unwrap_or_else(|| {
                errors.push(EvalError::Overflow("ABS"));
                i32::MAX
            }))
        }
        Func::Int => CesqlValue::Integer(to_int(next(), errors)),
        Func::Bool => CesqlValue::Boolean(match next() {
            CesqlValue::Integer(i) => i != 0,
            other => to_bool(other, errors),
        }),
        Func::String => CesqlValue::String(to_string(next())),
        Func::IsInt => CesqlValue::Boolean(match next() {
            CesqlValue::Integer(_) => true,
            CesqlValue::String(s) => parse_int(&s).is_some(),
            CesqlValue::Boolean(_) => false,
        }),
        Func::IsBool => CesqlValue::Boolean(match next() {
            CesqlValue::Boolean(_) => true,
            CesqlValue::String(s) => parse_bool(&s).is_some(),
            CesqlValue::Integer(_) => false,
        }),
    })
}

fn substring(s: &str, pos: i32, take: Option<i32>) -> Result<String, String> {
    let len = s.chars().count() as i64;
    let pos = i64::from(pos);
    if pos > len || pos < -len {
        return Err(format!(
            "position {pos} is outside a string of length {len}"
        ));
    }
    if let Some(t) = take {
        if t < 0 {
            return Err(format!("negative length {t}"));
        }
    }
    if pos == 0 {
        return Ok(String::new());
    }
    let start = if pos > 0 { pos - 1 } else { len + pos } as usize;
    let chars = s.chars().skip(start);
    Ok(match take {
        Some(t) => chars.take(t as usize).collect(),
        None => chars.collect(),
    })
}
