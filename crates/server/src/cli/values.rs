//! `key=value` options (`--argument`, `--property`, `--header`) as rabbitmqadmin reads them: a
//! value that is JSON keeps its type (`x-max-length=10` is a number, `x-single-active-consumer=true`
//! a boolean, `x-dead-letter-exchange=""` an empty string); anything else is a string.

use serde_json::{Map, Value};

/// One `key=value` pair, parsed (a clap value parser: a malformed pair is a usage error).
pub fn key_value(s: &str) -> Result<(String, Value), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got '{s}'"))?;
    if k.is_empty() {
        return Err(format!("expected KEY=VALUE, got '{s}' (the key is empty)"));
    }
    let value = serde_json::from_str::<Value>(v).unwrap_or_else(|_| Value::String(v.to_owned()));
    Ok((k.to_owned(), value))
}

/// The pairs as a JSON object (a later key wins).
pub fn object(pairs: &[(String, Value)]) -> Map<String, Value> {
    pairs.iter().cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_keep_their_json_type() {
        assert_eq!(
            key_value("x-max-length=10").unwrap(),
            ("x-max-length".into(), json!(10))
        );
        assert_eq!(
            key_value("x-single-active-consumer=true").unwrap().1,
            json!(true)
        );
        assert_eq!(key_value("x-queue-mode=lazy").unwrap().1, json!("lazy"));
        assert_eq!(
            key_value("x-dead-letter-exchange=\"\"").unwrap().1,
            json!("")
        );
        assert_eq!(key_value("x-dead-letter-exchange=").unwrap().1, json!(""));
        assert_eq!(key_value("ratio=0.5").unwrap().1, json!(0.5));
        assert_eq!(key_value("url=a=b").unwrap(), ("url".into(), json!("a=b")));
        assert_eq!(key_value("list=[1,\"a\"]").unwrap().1, json!([1, "a"]));
        assert_eq!(key_value("text=10 apples").unwrap().1, json!("10 apples"));
    }

    #[test]
    fn malformed_pairs_are_refused() {
        assert!(key_value("x-max-length").is_err());
        assert!(key_value("=5").is_err());
    }

    #[test]
    fn pairs_become_an_object() {
        let pairs = [
            key_value("a=1").unwrap(),
            key_value("b=x").unwrap(),
            key_value("a=2").unwrap(),
        ];
        assert_eq!(Value::Object(object(&pairs)), json!({"a": 2, "b": "x"}));
    }
}
