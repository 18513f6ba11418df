//! The lexer: expression text to tokens with their 1-based character positions.

use std::fmt;

use super::value::CesqlError;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Kind {
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
pub(super) struct Token {
    pub(super) kind: Kind,
    /// 1-based character position.
    pub(super) pos: usize,
}

pub(super) fn lex(src: &str) -> Result<Vec<Token>, CesqlError> {
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
