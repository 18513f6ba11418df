//! The recursive-descent parser: tokens to a syntax tree, with nesting bounded by
//! [`MAX_CESQL_DEPTH`].

use super::ast::{BinOp, Expr, Func};
use super::lexer::{lex, Kind, Token};
use super::like::like_pattern;
use super::value::{CesqlError, CesqlValue};

/// Deepest nesting an expression may have.
pub const MAX_CESQL_DEPTH: usize = 64;

/// Parses a whole expression.
pub(super) fn parse(source: &str) -> Result<Expr, CesqlError> {
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
    Ok(expr)
}

/// The binary operators of each precedence level, loosest first; keywords match in any case.
const LOGIC: &[(&str, BinOp)] = &[("AND", BinOp::And), ("OR", BinOp::Or), ("XOR", BinOp::Xor)];
const COMPARISON: &[(&str, BinOp)] = &[
    ("=", BinOp::Eq),
    ("!=", BinOp::Ne),
    ("<>", BinOp::Ne),
    ("<", BinOp::Lt),
    ("<=", BinOp::Le),
    (">", BinOp::Gt),
    (">=", BinOp::Ge),
];
const ADDITIVE: &[(&str, BinOp)] = &[("+", BinOp::Add), ("-", BinOp::Sub)];
const MULTIPLICATIVE: &[(&str, BinOp)] = &[("*", BinOp::Mul), ("/", BinOp::Div), ("%", BinOp::Mod)];

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

    /// The binary operator of `ops` at the cursor, if any.
    fn peek_binop(&self, ops: &[(&str, BinOp)]) -> Option<BinOp> {
        let text: &str = match &self.peek_token()?.kind {
            Kind::Op(o) => o,
            Kind::Word(w) => w,
            _ => return None,
        };
        ops.iter()
            .find(|(t, _)| t.eq_ignore_ascii_case(text))
            .map(|&(_, op)| op)
    }

    /// `next (op next)*` for the operators `ops` of one precedence level.
    fn chain(
        &mut self,
        next: fn(&mut Self) -> Result<Expr, CesqlError>,
        ops: &[(&str, BinOp)],
    ) -> Result<Expr, CesqlError> {
        let first = next(self)?;
        let mut rest = Vec::new();
        while let Some(o) = self.peek_binop(ops) {
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
        self.chain(Self::comparison, LOGIC)
    }

    fn comparison(&mut self) -> Result<Expr, CesqlError> {
        self.chain(Self::additive, COMPARISON)
    }

    fn additive(&mut self) -> Result<Expr, CesqlError> {
        self.chain(Self::multiplicative, ADDITIVE)
    }

    fn multiplicative(&mut self) -> Result<Expr, CesqlError> {
        self.chain(Self::postfix, MULTIPLICATIVE)
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
