//! The list endpoints' query parameters, as RabbitMQ's management API reads them: `name` (a
//! substring, or a regular expression with `use_regex=true`), `sort` (a field, dotted for
//! nested ones) and `sort_reverse`, `page` and `page_size` (with `page`, the answer is an
//! object around the page), `columns` (only these fields).

use std::cmp::Ordering;
use std::collections::HashMap;

use serde_json::{json, Map, Value};

use super::ApiError;

/// RabbitMQ's limit on `page_size`.
const MAX_PAGE_SIZE: usize = 500;
const DEFAULT_PAGE_SIZE: usize = 100;

/// The parsed query of a list request.
#[derive(Debug, Default)]
pub struct ListQuery {
    name: Option<String>,
    use_regex: bool,
    sort: Option<String>,
    sort_reverse: bool,
    page: Option<usize>,
    page_size: usize,
    columns: Option<Vec<String>>,
}

impl ListQuery {
    pub fn parse(q: &HashMap<String, String>) -> Result<ListQuery, ApiError> {
        let flag = |k: &str| q.get(k).is_some_and(|v| v == "true");
        let number = |k: &str| -> Result<Option<i64>, ApiError> {
            match q.get(k) {
                None => Ok(None),
                Some(v) => v
                    .parse::<i64>()
                    .map(Some)
                    .map_err(|_| ApiError::bad_request("Pagination parameters are invalid")),
            }
        };
        let page = number("page")?;
        let size = number("page_size")?;
        let invalid = || {
            let shown =
                |n: Option<i64>| n.map_or_else(|| "undefined".to_owned(), |n| n.to_string());
            ApiError::pagination(format!(
                "Invalid pagination parameters: page number {}, page size {}",
                shown(page),
                shown(size)
            ))
        };
        if page.is_some_and(|p| p < 1) {
            return Err(invalid());
        }
        let page_size = match size {
            None => DEFAULT_PAGE_SIZE,
            Some(n) => usize::try_from(n)
                .ok()
                .filter(|n| (1..=MAX_PAGE_SIZE).contains(n))
                .ok_or_else(invalid)?,
        };
        let page = page.map(|p| usize::try_from(p).unwrap_or(usize::MAX));
        Ok(ListQuery {
            // As RabbitMQ: the name filter applies to paged requests only.
            name: q
                .get("name")
                .filter(|n| !n.is_empty() && page.is_some())
                .cloned(),
            use_regex: flag("use_regex"),
            sort: q.get("sort").filter(|s| !s.is_empty()).cloned(),
            sort_reverse: flag("sort_reverse"),
            page,
            page_size,
            columns: q.get("columns").map(|c| {
                c.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            }),
        })
    }

    /// Is this name kept by the `name` filter? Checked before an item is rendered.
    pub fn matcher(&self) -> Result<impl Fn(&str) -> bool + '_, ApiError> {
        let regex = match (&self.name, self.use_regex) {
            (Some(n), true) => Some(
                regex_lite::Regex::new(n)
                    .map_err(|_| ApiError::bad_request("Pagination parameters are invalid"))?,
            ),
            _ => None,
        };
        Ok(move |name: &str| match (&self.name, &regex) {
            (None, _) => true,
            (Some(_), Some(r)) => r.is_match(name),
            // RabbitMQ's plain filter is a case-insensitive substring match.
            (Some(n), None) => name.to_lowercase().contains(&n.to_lowercase()),
        })
    }

    /// Sorts, pages and trims rendered `items` (already filtered by name; `total` before
    /// filtering).
    pub fn finish(&self, items: Vec<Value>, total: usize) -> Result<Value, ApiError> {
        let text = |v: &Value, k: &str| lookup(v, k).and_then(Value::as_str).map(str::to_owned);
        self.finish_with(
            items,
            total,
            |v, field| lookup(v, field).cloned(),
            |v| (text(v, "vhost"), text(v, "name")),
            |v| v,
        )
    }

    /// Sorts, pages and trims `items` (already filtered by name; `total` before filtering),
    /// rendering only the items of the page: with 10,000 queues, rendering each one to
    /// JSON costs far more than sorting them. `key` gives an item's value of a sort field
    /// as it would appear rendered; `names` its vhost and name, which break ties.
    pub fn finish_with<T, N: Ord>(
        &self,
        items: Vec<T>,
        total: usize,
        key: impl Fn(&T, &str) -> Option<Value>,
        names: impl Fn(&T) -> N,
        render: impl FnMut(T) -> Value,
    ) -> Result<Value, ApiError> {
        let field = self.sort.as_deref();
        let reverse = self.sort_reverse;
        let mut order: Vec<(Option<Value>, N, usize)> = items
            .iter()
            .enumerate()
            .map(|(i, item)| (field.and_then(|f| key(item, f)), names(item), i))
            .collect();
        // Ties go by vhost, then name, in both directions, so that pages are stable.
        order.sort_by(|a, b| {
            let by_key = match field {
                Some(_) => compare(a.0.as_ref(), b.0.as_ref()),
                None => Ordering::Equal,
            };
            let by_key = if reverse { by_key.reverse() } else { by_key };
            let ties = a.1.cmp(&b.1);
            by_key.then(if field.is_none() && reverse {
                ties.reverse()
            } else {
                ties
            })
        });
        let filtered = order.len();
        let (page, range) = match self.page {
            None => (None, 0..filtered),
            Some(page) => {
                let page_count = filtered.div_ceil(self.page_size).max(1);
                if page > page_count {
                    return Err(ApiError::page_out_of_range(format!(
                        "Page out of range, page: {page} page size: {}, len: {filtered}",
                        self.page_size
                    )));
                }
                let start = (page - 1) * self.page_size;
                let end = start.saturating_add(self.page_size).min(filtered);
                (Some((page, page_count)), start..end)
            }
        };
        let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
        let rendered: Vec<Value> = order
            .get(range)
            .unwrap_or_default()
            .iter()
            .filter_map(|(_, _, i)| slots.get_mut(*i).and_then(Option::take))
            .map(render)
            .collect();
        let Some((page, page_count)) = page else {
            return Ok(Value::Array(self.trim(rendered)));
        };
        Ok(json!({
            "filtered_count": filtered,
            "item_count": rendered.len(),
            "items": self.trim(rendered),
            "page": page,
            "page_count": page_count,
            "page_size": self.page_size,
            "total_count": total,
        }))
    }

    /// Keeps only the fields of `columns` (dotted paths keep the nested field).
    fn trim(&self, items: Vec<Value>) -> Vec<Value> {
        let Some(cols) = &self.columns else {
            return items;
        };
        items
            .into_iter()
            .map(|item| {
                let mut out = Map::new();
                for c in cols {
                    if let Some(v) = lookup(&item, c) {
                        insert_path(&mut out, c, v.clone());
                    }
                }
                Value::Object(out)
            })
            .collect()
    }
}

fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

fn insert_path(out: &mut Map<String, Value>, path: &str, v: Value) {
    match path.split_once('.') {
        None => {
            out.insert(path.to_owned(), v);
        }
        Some((head, rest)) => {
            let inner = out
                .entry(head.to_owned())
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(m) = inner {
                insert_path(m, rest, v);
            }
        }
    }
}

/// Numbers by value, strings by text; missing values first.
fn compare(a: Option<&Value>, b: Option<&Value>) -> Ordering {
    match (a, b) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => x
            .as_f64()
            .partial_cmp(&y.as_f64())
            .unwrap_or(Ordering::Equal),
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        (Some(Value::Bool(x)), Some(Value::Bool(y))) => x.cmp(y),
        (None | Some(Value::Null), None | Some(Value::Null)) => Ordering::Equal,
        (None | Some(Value::Null), _) => Ordering::Less,
        (_, None | Some(Value::Null)) => Ordering::Greater,
        (Some(x), Some(y)) => x.to_string().cmp(&y.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> ListQuery {
        let q = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ListQuery::parse(&q).unwrap()
    }

    fn items() -> Vec<Value> {
        (0..7)
            .map(|i| json!({"vhost": "/", "name": format!("q{i}"), "messages": (i * 3) % 7, "message_stats": {"ack": i}}))
            .collect()
    }

    #[test]
    fn pages_sorted_items_in_rabbitmq_shape() {
        let q = query(&[
            ("page", "2"),
            ("page_size", "3"),
            ("sort", "messages"),
            ("sort_reverse", "true"),
        ]);
        let v = q.finish(items(), 9).unwrap();
        assert_eq!(v["page_count"], 3);
        assert_eq!(v["filtered_count"], 7);
        assert_eq!(v["total_count"], 9);
        assert_eq!(v["item_count"], 3);
        let got: Vec<i64> = v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["messages"].as_i64().unwrap())
            .collect();
        assert_eq!(got, [3, 2, 1]);
        assert!(query(&[("page", "4"), ("page_size", "3")])
            .finish(items(), 7)
            .is_err());
    }

    #[test]
    fn filters_by_name_and_trims_columns() {
        let q = query(&[
            ("page", "1"),
            ("name", "^q[12]$"),
            ("use_regex", "true"),
            ("columns", "name,message_stats.ack"),
        ]);
        let m = q.matcher().unwrap();
        let kept: Vec<Value> = items()
            .into_iter()
            .filter(|i| m(i["name"].as_str().unwrap()))
            .collect();
        let v = q.finish(kept, 7).unwrap();
        assert_eq!(
            v["items"],
            json!([{"name": "q1", "message_stats": {"ack": 1}}, {"name": "q2", "message_stats": {"ack": 2}}])
        );
        let plain = query(&[("name", "Q3"), ("page", "1")]);
        assert!(plain.matcher().unwrap()("q3"));
        assert!(!plain.matcher().unwrap()("q4"));
        // Without a page the filter is ignored, as by RabbitMQ.
        assert!(query(&[("name", "Q3")]).matcher().unwrap()("q4"));
    }

    #[test]
    fn rejects_bad_paging() {
        let q: HashMap<String, String> = [("page_size".to_string(), "501".to_string())].into();
        assert!(ListQuery::parse(&q).is_err());
        let q: HashMap<String, String> = [("page".to_string(), "x".to_string())].into();
        assert!(ListQuery::parse(&q).is_err());
    }
}
