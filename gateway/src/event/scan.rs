//! A one-pass check that JSON data is what the decoder accepts, for the common case.
//!
//! Binary-mode JSON bodies are checked before they are stored (`stored::strict_json`: read
//! the way the decoder reads them, so an event that would not read back is refused). That
//! check runs serde_json's full parser and was the largest single cost of a request. This
//! scan answers the same question for plain JSON in one pass over the bytes, and says
//! `Unsure` for anything it does not vouch for: invalid JSON, surrogate escapes, numbers
//! with an exponent or a long integer part (where the decoder's float parsing decides),
//! deep nesting. The caller then runs the full check, which also gives the error message:
//! the scan can only make the check cheaper, never change its answer.

/// The scan's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// Valid, and read back by the decoder: the deepest nesting of arrays and objects, and
    /// whether a line break (`\n` or `\r`, only ever whitespace between tokens in a value
    /// the scan vouches for) is in the body.
    Valid { depth: u32, lines: bool },
    /// Not vouched for: run the full check.
    Unsure,
}

/// Nesting past which the scan leaves the answer to the full check.
const MAX_DEPTH: u32 = 64;
/// Integer digits (before any fraction) past which the full check decides (a float with
/// more than 308 digits overflows to infinity, which the decoder refuses).
const MAX_INT_DIGITS: usize = 300;

/// Scans `body` (one JSON value, whitespace around it allowed).
pub(crate) fn scan(body: &[u8]) -> Scan {
    // UTF-8 once for the whole body (an ASCII-fast check); the scan then only looks at
    // bytes below 0x80 for structure.
    if std::str::from_utf8(body).is_err() {
        return Scan::Unsure;
    }
    match Scanner::new(body).run() {
        Some((depth, lines)) => Scan::Valid { depth, lines },
        None => Scan::Unsure,
    }
}

/// The bytes that end a run of plain string content: `"`, `\\` and control characters.
const STRING_STOP: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = true;
        b += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

/// A loop over the bytes with the open arrays and objects as a bit stack (no recursion:
/// the cost per token is a few compares, which is what a body of small tokens needs).
struct Scanner<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Open containers: bit `d` set when the one at depth `d` (from 1) is an object.
    objects: u128,
    depth: u32,
    deepest: u32,
    lines: bool,
}

impl<'a> Scanner<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Scanner {
            bytes,
            at: 0,
            objects: 0,
            depth: 0,
            deepest: 0,
            lines: false,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b) = self.bytes.get(self.at) {
            match b {
                b' ' | b'\t' => {}
                b'\n' | b'\r' => self.lines = true,
                _ => return,
            }
            self.at += 1;
        }
    }

    fn expect(&mut self, b: u8) -> Option<()> {
        (self.peek() == Some(b)).then(|| self.at += 1)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.at.checked_add(word.len())?;
        (self.bytes.get(self.at..end) == Some(word)).then(|| self.at = end)
    }

    /// Opens an array or object (the bracket is at `at`).
    fn open(&mut self, object: bool) -> Option<()> {
        self.at += 1;
        self.depth += 1;
        self.deepest = self.deepest.max(self.depth);
        if self.depth > MAX_DEPTH {
            return None;
        }
        let bit = 1u128 << self.depth;
        if object {
            self.objects |= bit;
        } else {
            self.objects &= !bit;
        }
        Some(())
    }

    /// An object member's name and its colon; the value follows.
    fn key(&mut self) -> Option<()> {
        self.skip_ws();
        if self.peek()? != b'"' {
            return None;
        }
        self.string()?;
        self.skip_ws();
        self.expect(b':')
    }

    /// The whole body: `Some((deepest nesting, line breaks seen))` when it is one value the
    /// scan vouches for, with only whitespace around it.
    fn run(mut self) -> Option<(u32, bool)> {
        'value: loop {
            self.skip_ws();
            match self.peek()? {
                b'{' => {
                    self.open(true)?;
                    self.skip_ws();
                    if self.expect(b'}').is_some() {
                        self.depth -= 1;
                    } else {
                        self.key()?;
                        continue 'value;
                    }
                }
                b'[' => {
                    self.open(false)?;
                    self.skip_ws();
                    if self.expect(b']').is_some() {
                        self.depth -= 1;
                    } else {
                        continue 'value;
                    }
                }
                b'"' => self.string()?,
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'n' => self.literal(b"null")?,
                b'-' | b'0'..=b'9' => self.number()?,
                _ => return None,
            }
            // After a value: the end of the body, or a comma or the close of its container.
            loop {
                self.skip_ws();
                if self.depth == 0 {
                    return (self.at == self.bytes.len()).then_some((self.deepest, self.lines));
                }
                let object = self.objects & (1u128 << self.depth) != 0;
                match (self.peek()?, object) {
                    (b',', true) => {
                        self.at += 1;
                        self.key()?;
                        continue 'value;
                    }
                    (b',', false) => {
                        self.at += 1;
                        continue 'value;
                    }
                    (b'}', true) | (b']', false) => {
                        self.at += 1;
                        self.depth -= 1;
                    }
                    _ => return None,
                }
            }
        }
    }

    /// A string: no control characters, only the escapes JSON has; a `\u` escape of a
    /// surrogate is left to the full check (pairs and lone halves are its business).
    fn string(&mut self) -> Option<()> {
        let bytes = self.bytes;
        let mut at = self.at + 1;
        loop {
            while at < bytes.len() && !STRING_STOP[usize::from(bytes[at])] {
                at += 1;
            }
            match *bytes.get(at)? {
                b'"' => {
                    self.at = at + 1;
                    return Some(());
                }
                b'\\' => match *bytes.get(at + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => at += 2,
                    b'u' => {
                        let mut code = 0u32;
                        for &h in bytes.get(at + 2..at + 6)? {
                            code = code * 16 + char::from(h).to_digit(16)?;
                        }
                        if (0xD800..=0xDFFF).contains(&code) {
                            return None;
                        }
                        at += 6;
                    }
                    _ => return None,
                },
                _ => return None,
            }
        }
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?`; an exponent, or an integer part too long to be
    /// sure of, is left to the full check.
    fn number(&mut self) -> Option<()> {
        let bytes = self.bytes;
        let digits = |mut at: usize| {
            while matches!(bytes.get(at), Some(b'0'..=b'9')) {
                at += 1;
            }
            at
        };
        let mut at = self.at;
        if bytes.get(at) == Some(&b'-') {
            at += 1;
        }
        let start = at;
        at = match *bytes.get(at)? {
            b'0' => at + 1,
            b'1'..=b'9' => digits(at + 1),
            _ => return None,
        };
        if at - start > MAX_INT_DIGITS {
            return None;
        }
        if bytes.get(at) == Some(&b'.') {
            let end = digits(at + 1);
            if end == at + 1 {
                return None;
            }
            at = end;
        }
        if matches!(bytes.get(at), Some(b'e' | b'E')) {
            return None;
        }
        self.at = at;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoder_accepts(body: &[u8]) -> bool {
        serde_json::from_slice::<serde_json::Value>(body).is_ok()
    }

    #[test]
    fn vouches_only_for_what_the_decoder_reads() {
        let cases: &[&[u8]] = &[
            b"{}",
            b"[]",
            b" {\"a\": [1, -2, 3.25, 0, -0.5, true, false, null, \"x\"]} ",
            b"\"plain\"",
            b"12",
            b"-0",
            b"{\"k\":\"caf\xc3\xa9 \\n \\\" \\\\ \\/ \\u00e9 \\u0041\"}",
            b"{\"a\":{\"b\":{\"c\":[[[]]]}}}",
            // Left to the full check:
            b"1e400",
            b"1e5",
            b"\"\\ud800\"",
            b"\"\\ud83d\\ude00\"",
            b"\"\\udc00\"",
            // Invalid, for the full check to name:
            b"",
            b"{",
            b"[1,]",
            b"{\"a\":1,}",
            b"{\"a\" 1}",
            b"01",
            b"1.",
            b".5",
            b"-",
            b"+1",
            b"\"tab\there\"",
            b"\"\\x\"",
            b"\"\\u12g4\"",
            b"\"unterminated",
            b"nul",
            b"truex",
            b"{} {}",
            b"[1] x",
            b"\xef\xbb\xbf{}",
            b"\"\xff\"",
            b"NaN",
            b"{\"a\":1}\x0c",
        ];
        for body in cases {
            if let Scan::Valid { .. } = scan(body) {
                assert!(
                    decoder_accepts(body),
                    "the scan vouched for {:?}, which the decoder refuses",
                    String::from_utf8_lossy(body)
                );
            }
        }
        assert_eq!(
            scan(b"{\"a\":{\"b\":[1]}}"),
            Scan::Valid {
                depth: 3,
                lines: false
            }
        );
        assert_eq!(
            scan(b"7"),
            Scan::Valid {
                depth: 0,
                lines: false
            }
        );
        assert_eq!(
            scan(b"{\r\n  \"a\": [1,\n 2]\n}\n"),
            Scan::Valid {
                depth: 2,
                lines: true
            }
        );
        assert_eq!(scan(b"1e400"), Scan::Unsure);
        assert_eq!(scan(b"[1,]"), Scan::Unsure);
    }

    #[test]
    fn the_depth_matches_the_full_checks() {
        for depth in [1usize, 2, 10, 64] {
            let body = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            assert_eq!(
                scan(body.as_bytes()),
                Scan::Valid {
                    depth: depth as u32,
                    lines: false
                }
            );
        }
        let deep = format!("{}{}", "[".repeat(65), "]".repeat(65));
        assert_eq!(scan(deep.as_bytes()), Scan::Unsure);
    }

    proptest::proptest! {
        /// Whatever the bytes, the scan never vouches for a body the decoder refuses.
        #[test]
        fn never_vouches_for_what_the_decoder_refuses(body in proptest::collection::vec(
            proptest::sample::select(b"{}[]\":,0123456789-.eE+ \\utrfalsn\x1f\xc3\xa9ud800\n\r".to_vec()),
            0..40,
        )) {
            if let Scan::Valid { lines, .. } = scan(&body) {
                proptest::prop_assert!(decoder_accepts(&body), "{:?}", String::from_utf8_lossy(&body));
                proptest::prop_assert_eq!(lines, body.contains(&b'\n') || body.contains(&b'\r'));
            }
        }

        /// Every JSON value serde_json writes is vouched for or left to the full check,
        /// and the scan agrees with it on what is valid.
        #[test]
        fn agrees_on_generated_json(value in json_value()) {
            for text in [serde_json::to_vec(&value).unwrap(), serde_json::to_vec_pretty(&value).unwrap()] {
                if let Scan::Valid { lines, .. } = scan(&text) {
                    proptest::prop_assert!(decoder_accepts(&text));
                    proptest::prop_assert_eq!(lines, text.contains(&b'\n'));
                }
            }
        }
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            ".*".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(".*", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
