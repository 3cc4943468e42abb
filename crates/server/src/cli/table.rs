//! Plain aligned tables of API objects: one column per field, numbers right-aligned.

use serde_json::Value;

/// A column: its title and the field it shows (dotted for nested fields: `queue.name`).
#[derive(Debug, Clone, Copy)]
pub struct Column {
    pub title: &'static str,
    pub field: &'static str,
}

pub const fn col(title: &'static str, field: &'static str) -> Column {
    Column { title, field }
}

/// The value at a dotted path.
fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

/// A value as a cell: text as is, whole numbers without a fraction, lists joined by commas.
pub fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => i.to_string(),
            (None, Some(f)) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{f:.0}"),
            (None, Some(f)) => format!("{f:.1}"),
            _ => n.to_string(),
        },
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| cell(Some(x)))
            .collect::<Vec<_>>()
            .join(","),
        Some(Value::Object(o)) if o.is_empty() => String::new(),
        Some(obj) => obj.to_string(),
    }
}

/// The table of `items` under `columns`: a header line, then one line per item.
pub fn render(columns: &[Column], items: &[Value]) -> String {
    let rows: Vec<Vec<(String, bool)>> = items
        .iter()
        .map(|item| {
            columns
                .iter()
                .map(|c| {
                    let v = lookup(item, c.field);
                    (cell(v), matches!(v, Some(Value::Number(_))))
                })
                .collect()
        })
        .collect();
    let widths: Vec<usize> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            rows.iter()
                .map(|r| r[i].0.chars().count())
                .chain([c.title.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<(String, bool)>| {
        let mut out = String::new();
        for (i, (text, right)) in cells.into_iter().enumerate() {
            let pad = widths[i].saturating_sub(text.chars().count());
            if i > 0 {
                out.push_str("  ");
            }
            if right {
                out.push_str(&" ".repeat(pad));
                out.push_str(&text);
            } else {
                out.push_str(&text);
                out.push_str(&" ".repeat(pad));
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(
        columns
            .iter()
            .map(|c| (c.title.to_owned(), false))
            .collect(),
    );
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn columns_are_aligned_and_numbers_right_aligned() {
        let cols = [
            col("name", "name"),
            col("ready", "messages_ready"),
            col("state", "state"),
        ];
        let items = [
            json!({"name": "jobs", "messages_ready": 12345, "state": "running"}),
            json!({"name": "a-much-longer-name", "messages_ready": 7}),
        ];
        assert_eq!(
            render(&cols, &items),
            "name                ready  state\n\
             jobs                12345  running\n\
             a-much-longer-name      7\n"
        );
    }

    #[test]
    fn nested_fields_lists_and_fractions_become_cells() {
        let cols = [
            col("queue", "queue.name"),
            col("tags", "tags"),
            col("age", "age"),
        ];
        let items =
            [json!({"queue": {"name": "q"}, "tags": ["administrator", "monitoring"], "age": 1.25})];
        assert_eq!(
            render(&cols, &items),
            "queue  tags                      age\nq      administrator,monitoring  1.2\n"
        );
        assert_eq!(cell(Some(&json!(3.0))), "3");
        assert_eq!(cell(Some(&json!(true))), "true");
        assert_eq!(cell(None), "");
    }

    #[test]
    fn an_empty_list_is_just_the_header() {
        assert_eq!(render(&[col("name", "name")], &[]), "name\n");
    }
}
