//! The compiled form of a pattern (conjunctions of field conditions, each with its
//! matchers) and how one leaf found in an event is tested against a matcher.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::view::{fold, Attr, Leaf, NumKey};

#[derive(Debug, Clone)]
pub(crate) struct Conjunction {
    pub(crate) conditions: Vec<FieldCondition>,
}

#[derive(Debug, Clone)]
pub(crate) struct FieldCondition {
    /// Full path; `path[0]` is the attribute name or `data`.
    pub(crate) path: Vec<String>,
    pub(crate) attr: Attr,
    pub(crate) matchers: Vec<Matcher>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Scalar {
    Null,
    Bool(bool),
    Num(NumKey),
    Str(String),
}

impl Scalar {
    fn equals(&self, leaf: Leaf<'_>) -> bool {
        match (self, leaf) {
            (Scalar::Null, Leaf::Null) => true,
            (Scalar::Bool(a), Leaf::Bool(b)) => *a == b,
            (Scalar::Num(k), Leaf::Num(n)) => *k == n.key,
            (Scalar::Str(a), Leaf::Str(b)) => a == b,
            _ => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Bound {
    pub(crate) value: f64,
    pub(crate) inclusive: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Range {
    pub(crate) lower: Option<Bound>,
    pub(crate) upper: Option<Bound>,
}

impl Range {
    pub(crate) fn contains(&self, x: f64) -> bool {
        let lower_ok = match &self.lower {
            None => true,
            Some(b) if b.inclusive => x >= b.value,
            Some(b) => x > b.value,
        };
        let upper_ok = match &self.upper {
            None => true,
            Some(b) if b.inclusive => x <= b.value,
            Some(b) => x < b.value,
        };
        lower_ok && upper_ok
    }
}

/// A `*` glob; `parts` are the literal pieces between stars.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Wildcard {
    parts: Vec<String>,
}

impl Wildcard {
    pub(super) fn parse(s: &str) -> Result<Wildcard, String> {
        let mut parts = vec![String::new()];
        let mut chars = s.chars();
        let mut last_was_star = false;
        while let Some(c) = chars.next() {
            match c {
                '*' => {
                    if last_was_star {
                        return Err("consecutive `*` are not allowed in a wildcard".into());
                    }
                    parts.push(String::new());
                    last_was_star = true;
                    continue;
                }
                '\\' => {
                    let escaped = match chars.next() {
                        Some(e @ ('*' | '\\')) => e,
                        _ => {
                            return Err(
                                "a `\\` in a wildcard must be followed by `*` or `\\`".into()
                            )
                        }
                    };
                    push_char(&mut parts, escaped);
                }
                other => push_char(&mut parts, other),
            }
            last_was_star = false;
        }
        Ok(Wildcard { parts })
    }

    pub(crate) fn matches(&self, s: &str) -> bool {
        let (first, rest) = match self.parts.split_first() {
            Some(x) => x,
            None => return s.is_empty(),
        };
        let Some((last, middle)) = rest.split_last() else {
            return s == first;
        };
        if s.len() < first.len() + last.len() || !s.starts_with(first.as_str()) {
            return false;
        }
        if !s.ends_with(last.as_str()) {
            return false;
        }
        let Some(mut region) = s.get(first.len()..s.len() - last.len()) else {
            return false;
        };
        for part in middle {
            match region.find(part.as_str()) {
                Some(at) => match region.get(at + part.len()..) {
                    Some(r) => region = r,
                    None => return false,
                },
                None => return false,
            }
        }
        true
    }
}

fn push_char(parts: &mut [String], c: char) {
    if let Some(last) = parts.last_mut() {
        last.push(c);
    }
}

/// The `cidr` matcher's network (`ipnet`): an address and a prefix length, IPv4 or IPv6.
/// An address of the other family is never inside it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Cidr(IpNet);

impl Cidr {
    /// Parsed here rather than by `IpNet::from_str`, whose one error ("invalid IP address
    /// syntax") does not say which part is wrong; blanks around either part are allowed.
    pub(super) fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, len) = s
            .split_once('/')
            .ok_or_else(|| format!("`{s}` is not in CIDR notation (address/prefix-length)"))?;
        let net: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("`{addr}` is not an IPv4 or IPv6 address"))?;
        let prefix: u8 = len
            .trim()
            .parse()
            .map_err(|_| format!("`{len}` is not a prefix length"))?;
        IpNet::new(net, prefix).map(Cidr).map_err(|_| {
            let max = if net.is_ipv4() { 32 } else { 128 };
            format!("prefix length {prefix} is larger than {max}")
        })
    }

    pub(crate) fn contains(&self, s: &str) -> bool {
        s.trim()
            .parse::<IpAddr>()
            .is_ok_and(|ip| self.0.contains(&ip))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Matcher {
    Exact(Scalar),
    Prefix(String),
    /// Folded prefix.
    PrefixIgnoreCase(String),
    Suffix(String),
    SuffixIgnoreCase(String),
    /// Folded value.
    EqualsIgnoreCase(String),
    Wildcard(Wildcard),
    AnythingBut(Vec<Scalar>),
    AnythingButPrefix(Vec<String>),
    AnythingButSuffix(Vec<String>),
    AnythingButWildcard(Vec<Wildcard>),
    /// Folded values.
    AnythingButIgnoreCase(Vec<String>),
    Numeric(Range),
    Cidr(Cidr),
    Exists(bool),
}

impl Matcher {
    /// Whether one leaf satisfies this matcher. `Exists` is decided per path, not per leaf.
    pub(crate) fn test(&self, leaf: Leaf<'_>) -> bool {
        match self {
            Matcher::Exact(s) => s.equals(leaf),
            Matcher::Numeric(r) => matches!(leaf, Leaf::Num(n) if r.contains(n.f)),
            Matcher::AnythingBut(list) => !list.iter().any(|s| s.equals(leaf)),
            Matcher::Exists(_) => false,
            _ => match leaf {
                Leaf::Str(s) => self.test_str(s),
                _ => false,
            },
        }
    }

    fn test_str(&self, s: &str) -> bool {
        match self {
            Matcher::Prefix(p) => s.starts_with(p.as_str()),
            Matcher::PrefixIgnoreCase(p) => fold(s).starts_with(p.as_str()),
            Matcher::Suffix(p) => s.ends_with(p.as_str()),
            Matcher::SuffixIgnoreCase(p) => fold(s).ends_with(p.as_str()),
            Matcher::EqualsIgnoreCase(v) => fold(s) == *v,
            Matcher::Wildcard(w) => w.matches(s),
            Matcher::AnythingButPrefix(ps) => !ps.iter().any(|p| s.starts_with(p.as_str())),
            Matcher::AnythingButSuffix(ps) => !ps.iter().any(|p| s.ends_with(p.as_str())),
            Matcher::AnythingButWildcard(ws) => !ws.iter().any(|w| w.matches(s)),
            Matcher::AnythingButIgnoreCase(vs) => !vs.contains(&fold(s)),
            Matcher::Cidr(c) => c.contains(s),
            _ => false,
        }
    }
}

impl FieldCondition {
    pub(crate) fn rest(&self) -> &[String] {
        self.path.get(1..).unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::Cidr;

    #[test]
    fn cidr_parses_and_contains_as_before() {
        let v4 = Cidr::parse(" 10.1.2.3 / 16 ").unwrap();
        assert!(v4.contains("10.1.255.255") && v4.contains(" 10.1.0.0 "));
        assert!(!v4.contains("10.2.0.0") && !v4.contains("::ffff:10.1.0.1"));
        let v6 = Cidr::parse("2001:db8::1/127").unwrap();
        assert!(v6.contains("2001:db8::") && !v6.contains("2001:db8::2"));
        assert!(!v6.contains("10.1.0.1") && !v6.contains("not an address"));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("255.255.255.255"));
        assert!(Cidr::parse("::/0").unwrap().contains("ffff::"));
        for (bad, message) in [
            (
                "10.0.0.0",
                "`10.0.0.0` is not in CIDR notation (address/prefix-length)",
            ),
            ("10.0.0/8", "`10.0.0` is not an IPv4 or IPv6 address"),
            ("10.0.0.0/x", "`x` is not a prefix length"),
            ("10.0.0.0/256", "`256` is not a prefix length"),
            ("10.0.0.0/33", "prefix length 33 is larger than 32"),
            ("::/129", "prefix length 129 is larger than 128"),
        ] {
            assert_eq!(Cidr::parse(bad).unwrap_err(), message, "{bad}");
        }
    }
}
