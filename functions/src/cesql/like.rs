//! `LIKE` patterns: compiled from the string literal at parse time, matched at evaluation.

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LikePart {
    Lit(char),
    One,
    Many,
}

pub(super) fn like_pattern(s: &str) -> Vec<LikePart> {
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

pub(super) fn like_matches(pattern: &[LikePart], s: &str) -> bool {
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
