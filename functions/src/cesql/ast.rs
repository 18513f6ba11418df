//! The syntax tree the parser builds and the evaluator walks.

use super::like::LikePart;
use super::value::CesqlValue;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BinOp {
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
pub(super) enum Func {
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
    pub(super) fn lookup(name: &str, arity: usize) -> Result<Func, String> {
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

    pub(super) fn name(self) -> &'static str {
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

#[derive(Debug, Clone)]
pub(super) enum Expr {
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
