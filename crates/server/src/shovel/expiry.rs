//! A moved message's time to live, carried over as what is left of it (`warren migrate`).
//!
//! AMQP 0-9-1 does not say when a message entered its queue. One case says it exactly: a
//! message the broker dead-lettered into its queue (a retry queue's delay) carries that time
//! in its newest `x-death` entry, as long as that entry's `count` is 1 (a second death of the
//! same queue and reason raises the count and keeps the first time). Its age is taken from
//! there, less the second the time was truncated to. Every other message counts its time to
//! live again from its arrival: late, never early. (The `timestamp` property is not used: a
//! publisher sets it, and a republished message or a client's clock behind would make the
//! copy expire before it would have.)

use lapin::types::{AMQPValue, ShortString};
use lapin::BasicProperties;

/// When the broker dead-lettered the message into its queue (ms since the epoch; the end of
/// that second), if its newest `x-death` entry says so exactly.
fn dead_lettered_at_ms(props: &BasicProperties) -> Option<u64> {
    let AMQPValue::FieldArray(deaths) = props.headers().as_ref()?.inner().get("x-death")? else {
        return None;
    };
    // The newest entry first, as RabbitMQ keeps them.
    let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else {
        return None;
    };
    let first_death = match newest.inner().get("count")? {
        AMQPValue::LongLongInt(n) => *n == 1,
        AMQPValue::LongInt(n) => *n == 1,
        AMQPValue::LongUInt(n) => *n == 1,
        _ => false,
    };
    match newest.inner().get("time")? {
        AMQPValue::Timestamp(t) if first_death => Some(t.saturating_mul(1000).saturating_add(999)),
        _ => None,
    }
}

/// `props` with its `expiration` set to what is left of its time to live at `now_ms`: the
/// lower of its own and the queue's (`queue_ttl_ms`, the source queue's `x-message-ttl` or
/// policy), less its age. Unchanged when its age is not known or it has no TTL.
pub fn carried(props: BasicProperties, queue_ttl_ms: Option<u64>, now_ms: u64) -> BasicProperties {
    let Some(at) = dead_lettered_at_ms(&props) else {
        return props;
    };
    let own = props
        .expiration()
        .as_ref()
        .and_then(|e| e.as_str().trim().parse::<u64>().ok());
    let Some(ttl) = own.into_iter().chain(queue_ttl_ms).min() else {
        return props;
    };
    let left = ttl.saturating_sub(now_ms.saturating_sub(at));
    props.with_expiration(ShortString::from(left.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, FieldTable};

    const NOW: u64 = 1_800_000_000_000;

    fn dead_lettered(secs: u64, count: i64) -> FieldTable {
        let mut entry = FieldTable::default();
        entry.insert("count".into(), AMQPValue::LongLongInt(count));
        entry.insert("time".into(), AMQPValue::Timestamp(secs));
        entry.insert("queue".into(), AMQPValue::LongString("work".into()));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)])),
        );
        h
    }

    fn expiration(p: &BasicProperties) -> Option<String> {
        p.expiration().as_ref().map(|e| e.as_str().to_owned())
    }

    #[test]
    fn a_dead_lettered_message_keeps_what_is_left_of_its_wait() {
        // Dead-lettered into a 5 s retry queue 4 s ago: 1 s left (and the second's rounding).
        let p = BasicProperties::default().with_headers(dead_lettered(NOW / 1000 - 4, 1));
        assert_eq!(
            expiration(&carried(p, Some(5_000), NOW)).as_deref(),
            Some("1999")
        );
        // Its own expiration is lower than the queue's: it counts.
        let p = BasicProperties::default()
            .with_headers(dead_lettered(NOW / 1000 - 4, 1))
            .with_expiration("3000".into());
        assert_eq!(
            expiration(&carried(p, Some(5_000), NOW)).as_deref(),
            Some("0")
        );
        // Past its time: due at once.
        let p = BasicProperties::default().with_headers(dead_lettered(NOW / 1000 - 100, 1));
        assert_eq!(
            expiration(&carried(p, Some(5_000), NOW)).as_deref(),
            Some("0")
        );
    }

    #[test]
    fn a_message_whose_age_is_not_known_keeps_its_ttl() {
        // A second death keeps the first one's time: not this arrival's.
        let p = BasicProperties::default()
            .with_headers(dead_lettered(NOW / 1000 - 100, 2))
            .with_expiration("60000".into());
        assert_eq!(
            expiration(&carried(p, Some(5_000), NOW)).as_deref(),
            Some("60000")
        );
        // A publisher's timestamp is not the arrival.
        let p = BasicProperties::default()
            .with_timestamp(NOW / 1000 - 100)
            .with_expiration("60000".into());
        assert_eq!(expiration(&carried(p, None, NOW)).as_deref(), Some("60000"));
        // No TTL at all.
        let p = BasicProperties::default().with_headers(dead_lettered(NOW / 1000 - 4, 1));
        assert_eq!(expiration(&carried(p, None, NOW)), None);
        // A time ahead of this clock (another host's): no age.
        let p = BasicProperties::default().with_headers(dead_lettered(NOW / 1000 + 100, 1));
        assert_eq!(
            expiration(&carried(p, Some(5_000), NOW)).as_deref(),
            Some("5000")
        );
    }
}
