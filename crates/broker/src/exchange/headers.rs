//! Headers routing, as RabbitMQ's `rabbit_exchange_type_headers`.
//!
//! A binding's arguments are the pattern; `x-match` says how it matches: `all` (the default),
//! `any`, `all-with-x`, `any-with-x`. Pattern keys starting with `x-` are ignored unless the
//! mode is a `-with-x` one; `x-match` itself is always ignored. A pattern value of type void
//! matches the mere presence of the header. Values compare as Erlang's `==` does. Both sides
//! are sorted by key and merged in linear time, exactly like RabbitMQ (including its
//! behaviour with duplicate keys).

use warren_codec::{AmqpError, FieldTable, FieldValue, ShortStr};

use crate::erl;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatchKind {
    All,
    Any,
    AllWithX,
    AnyWithX,
}

/// A parsed headers binding.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadersSpec {
    kind: MatchKind,
    /// Pattern entries that take part, sorted by key (stable).
    pattern: Vec<(ShortStr, FieldValue)>,
}

/// `validate_binding/2`: rejects a bad `x-match` with RabbitMQ's 406 text.
pub fn validate(args: &FieldTable) -> Result<(), AmqpError> {
    match args.get("x-match") {
        None => Ok(()),
        Some(FieldValue::LongStr(b)) => match &b[..] {
            b"all" | b"any" | b"all-with-x" | b"any-with-x" => Ok(()),
            other => Err(AmqpError::precondition_failed(format!(
                "Invalid x-match field value {}; expected all, any, all-with-x, or any-with-x",
                erl::binary(other)
            ))),
        },
        Some(other) => Err(AmqpError::precondition_failed(format!(
            "Invalid x-match field type {} (value {}); expected longstr",
            other.type_name(),
            erl::term(other)
        ))),
    }
}

impl HeadersSpec {
    pub fn parse(args: &FieldTable) -> HeadersSpec {
        let kind = match args.get("x-match") {
            Some(FieldValue::LongStr(b)) => match &b[..] {
                b"any" => MatchKind::Any,
                b"all-with-x" => MatchKind::AllWithX,
                b"any-with-x" => MatchKind::AnyWithX,
                _ => MatchKind::All,
            },
            _ => MatchKind::All,
        };
        let with_x = matches!(kind, MatchKind::AllWithX | MatchKind::AnyWithX);
        let mut pattern: Vec<(ShortStr, FieldValue)> = args
            .iter()
            .filter(|(k, _)| &**k != "x-match" && (with_x || !k.starts_with("x-")))
            .cloned()
            .collect();
        pattern.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        HeadersSpec { kind, pattern }
    }

    /// Does a message with these headers (sorted by key, see [`sorted_headers`]) match?
    pub fn matches(&self, data: &[(ShortStr, FieldValue)]) -> bool {
        let all_kind = matches!(self.kind, MatchKind::All | MatchKind::AllWithX);
        let (mut all, mut any) = (true, false);
        let (mut p, mut d) = (0, 0);
        loop {
            if all_kind && !all {
                return false;
            }
            if !all_kind && any {
                return true;
            }
            let Some((pk, pv)) = self.pattern.get(p) else {
                return if all_kind { all } else { any };
            };
            let Some((dk, dv)) = data.get(d) else {
                // Pattern entries left but no data: fails "all".
                return if all_kind { false } else { any };
            };
            match pk.as_bytes().cmp(dk.as_bytes()) {
                std::cmp::Ordering::Greater => d += 1,
                std::cmp::Ordering::Less => {
                    all = false;
                    p += 1;
                }
                std::cmp::Ordering::Equal => {
                    if matches!(pv, FieldValue::Void) || erl::value_eq(pv, dv) {
                        any = true;
                    } else {
                        all = false;
                    }
                    p += 1;
                    d += 1;
                }
            }
        }
    }
}

/// A message's headers, sorted by key (stable, like `rabbit_misc:sort_field_table/1`).
pub fn sorted_headers(headers: Option<FieldTable>) -> Vec<(ShortStr, FieldValue)> {
    let mut v = headers.map(FieldTable::into_inner).unwrap_or_default();
    v.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&'static str, FieldValue)]) -> FieldTable {
        let mut t = FieldTable::new();
        for (k, v) in pairs {
            t.0.push(((*k).into(), v.clone()));
        }
        t
    }

    fn m(binding: &[(&'static str, FieldValue)], headers: &[(&'static str, FieldValue)]) -> bool {
        HeadersSpec::parse(&table(binding)).matches(&sorted_headers(Some(table(headers))))
    }

    fn s(v: &str) -> FieldValue {
        FieldValue::long_str(v)
    }

    #[test]
    fn all_and_any() {
        let b = [("a", s("1")), ("b", s("2"))];
        assert!(m(&b, &[("b", s("2")), ("a", s("1")), ("c", s("3"))]));
        assert!(!m(&b, &[("a", s("1"))]));
        assert!(!m(&b, &[("a", s("1")), ("b", s("x"))]));
        let any = [("x-match", s("any")), ("a", s("1")), ("b", s("2"))];
        assert!(m(&any, &[("a", s("1"))]));
        assert!(m(&any, &[("b", s("2")), ("z", s("0"))]));
        assert!(!m(&any, &[("a", s("2"))]));
        assert!(!m(&any, &[]));
    }

    #[test]
    fn empty_patterns() {
        // all with nothing to match matches everything; any matches nothing.
        assert!(m(&[], &[]));
        assert!(m(&[("x-match", s("all"))], &[("a", s("1"))]));
        assert!(!m(&[("x-match", s("any"))], &[("a", s("1"))]));
    }

    #[test]
    fn x_keys() {
        let b = [("x-match", s("all")), ("x-foo", s("1")), ("a", s("1"))];
        assert!(m(&b, &[("a", s("1"))]));
        let b = [
            ("x-match", s("all-with-x")),
            ("x-foo", s("1")),
            ("a", s("1")),
        ];
        assert!(!m(&b, &[("a", s("1"))]));
        assert!(m(&b, &[("a", s("1")), ("x-foo", s("1"))]));
        let b = [("x-match", s("any-with-x")), ("x-foo", s("1"))];
        assert!(m(&b, &[("x-foo", s("1"))]));
        assert!(!m(
            &[("x-match", s("any")), ("x-foo", s("1"))],
            &[("x-foo", s("1"))]
        ));
    }

    #[test]
    fn void_means_presence_and_numbers_compare_by_value() {
        assert!(m(&[("a", FieldValue::Void)], &[("a", s("anything"))]));
        assert!(!m(&[("a", FieldValue::Void)], &[("b", s("x"))]));
        assert!(m(
            &[("n", FieldValue::I32(1))],
            &[("n", FieldValue::I64(1))]
        ));
        assert!(m(
            &[("n", FieldValue::I32(1))],
            &[("n", FieldValue::F64(1.0))]
        ));
        assert!(!m(&[("n", FieldValue::I32(1))], &[("n", s("1"))]));
    }

    /// Which bindings match which headers, as RabbitMQ 3.10.8 routed them (measured with
    /// pika: ints as signedint, or long past 32 bits; None as void; dicts as tables).
    #[test]
    fn same_matches_as_rabbitmq() {
        fn nested() -> FieldValue {
            FieldValue::Table(table(&[("k", FieldValue::I32(1))]))
        }
        let any = || ("x-match", s("any"));
        let bindings: Vec<(&str, Vec<(&'static str, FieldValue)>)> = vec![
            ("all-empty", vec![]),
            ("any-empty", vec![any()]),
            ("all-a1-b2", vec![("a", FieldValue::I32(1)), ("b", s("2"))]),
            (
                "any-a1-b2",
                vec![any(), ("a", FieldValue::I32(1)), ("b", s("2"))],
            ),
            ("all-xfoo", vec![("x-foo", s("1"))]),
            (
                "allx-xfoo",
                vec![("x-match", s("all-with-x")), ("x-foo", s("1"))],
            ),
            (
                "anyx-xfoo-a",
                vec![
                    ("x-match", s("any-with-x")),
                    ("x-foo", s("1")),
                    ("a", FieldValue::I32(2)),
                ],
            ),
            ("all-void", vec![("a", FieldValue::Void)]),
            (
                "any-void-b",
                vec![any(), ("a", FieldValue::Void), ("b", s("zz"))],
            ),
            ("all-bool", vec![("t", FieldValue::Bool(true))]),
            ("all-str1", vec![("a", s("1"))]),
            ("all-nested", vec![("n", nested())]),
        ];
        type Pairs = Vec<(&'static str, FieldValue)>;
        let messages: Vec<(&str, Option<Pairs>)> = vec![
            ("none", None),
            ("a1", Some(vec![("a", FieldValue::I32(1))])),
            (
                "a1-b2",
                Some(vec![("a", FieldValue::I32(1)), ("b", s("2"))]),
            ),
            (
                "b2-a1",
                Some(vec![("b", s("2")), ("a", FieldValue::I32(1))]),
            ),
            ("a1big", Some(vec![("a", FieldValue::I64(1 << 40))])),
            ("a-str1", Some(vec![("a", s("1"))])),
            (
                "a-dec1",
                Some(vec![("a", FieldValue::Decimal { scale: 0, value: 1 })]),
            ),
            ("xfoo1", Some(vec![("x-foo", s("1"))])),
            (
                "xfoo1-a2",
                Some(vec![("x-foo", s("1")), ("a", FieldValue::I32(2))]),
            ),
            ("a2", Some(vec![("a", FieldValue::I32(2))])),
            ("t-true", Some(vec![("t", FieldValue::Bool(true))])),
            ("t-1", Some(vec![("t", FieldValue::I32(1))])),
            ("nested", Some(vec![("n", nested())])),
            ("a-none", Some(vec![("a", FieldValue::Void)])),
        ];
        let rabbitmq: Vec<(&str, &[&str])> = vec![
            ("none", &["all-empty", "all-xfoo"]),
            (
                "a1",
                &[
                    "all-empty",
                    "any-a1-b2",
                    "all-xfoo",
                    "all-void",
                    "any-void-b",
                ],
            ),
            (
                "a1-b2",
                &[
                    "all-empty",
                    "all-a1-b2",
                    "any-a1-b2",
                    "all-xfoo",
                    "all-void",
                    "any-void-b",
                ],
            ),
            (
                "b2-a1",
                &[
                    "all-empty",
                    "all-a1-b2",
                    "any-a1-b2",
                    "all-xfoo",
                    "all-void",
                    "any-void-b",
                ],
            ),
            (
                "a1big",
                &["all-empty", "all-xfoo", "all-void", "any-void-b"],
            ),
            (
                "a-str1",
                &[
                    "all-empty",
                    "all-xfoo",
                    "all-void",
                    "any-void-b",
                    "all-str1",
                ],
            ),
            (
                "a-dec1",
                &["all-empty", "all-xfoo", "all-void", "any-void-b"],
            ),
            (
                "xfoo1",
                &["all-empty", "all-xfoo", "allx-xfoo", "anyx-xfoo-a"],
            ),
            (
                "xfoo1-a2",
                &[
                    "all-empty",
                    "all-xfoo",
                    "allx-xfoo",
                    "anyx-xfoo-a",
                    "all-void",
                    "any-void-b",
                ],
            ),
            (
                "a2",
                &[
                    "all-empty",
                    "all-xfoo",
                    "anyx-xfoo-a",
                    "all-void",
                    "any-void-b",
                ],
            ),
            ("t-true", &["all-empty", "all-xfoo", "all-bool"]),
            ("t-1", &["all-empty", "all-xfoo"]),
            ("nested", &["all-empty", "all-xfoo", "all-nested"]),
            (
                "a-none",
                &["all-empty", "all-xfoo", "all-void", "any-void-b"],
            ),
        ];
        for (msg, want) in rabbitmq {
            let headers = messages
                .iter()
                .find(|(m, _)| *m == msg)
                .map(|(_, h)| sorted_headers(h.as_ref().map(|h| table(h))))
                .expect("message");
            let got: Vec<&str> = bindings
                .iter()
                .filter(|(_, b)| HeadersSpec::parse(&table(b)).matches(&headers))
                .map(|(n, _)| *n)
                .collect();
            assert_eq!(got, want.to_vec(), "message {msg}");
        }
    }

    #[test]
    fn validation_texts() {
        let e = validate(&table(&[("x-match", s("some"))])).expect_err("bad value");
        assert_eq!(
            e.text,
            "Invalid x-match field value <<\"some\">>; expected all, any, all-with-x, or any-with-x"
        );
        let e = validate(&table(&[("x-match", FieldValue::I32(1))])).expect_err("bad type");
        assert_eq!(
            e.text,
            "Invalid x-match field type signedint (value 1); expected longstr"
        );
        assert!(validate(&table(&[("x-match", s("any-with-x"))])).is_ok());
        assert!(validate(&FieldTable::new()).is_ok());
    }
}
