//! A moved message's time to live, carried over as what is left of it (`warren migrate`).
//!
//! AMQP 0-9-1 does not say when a message entered its queue, so the time it already spent
//! there is read from what the message says of itself: its `timestamp` property (set by many
//! publishers when they publish) and the time of its newest `x-death` entry (when it was
//! dead-lettered into this queue: a retry queue's delay). The later of the two is taken, plus
//! the second they were truncated to, so the age is never counted larger than those times
//! allow. A message that says neither counts its time to live again from its arrival (late,
//! never early).

use lapin::types::{AMQPValue, ShortString};
use lapin::BasicProperties;

/// The latest time (ms since the epoch) the message says it was at: its `timestamp`, or its
/// newest dead-lettering; the end of that second.
fn said_at_ms(props: &BasicProperties) -> Option<u64> {
    let stamp = props.timestamp().map(|s| s.saturating_mul(1000));
    let death = props.headers().as_ref().and_then(|h| {
        let AMQPValue::FieldArray(deaths) = h.inner().get("x-death")? else {
            return None;
        };
        // The newest entry first, as RabbitMQ keeps them.
        let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else {
            return None;
        };
        match newest.inner().get("time")? {
            AMQPValue::Timestamp(t) => Some(t.saturating_mul(1000)),
            _ => None,
        }
    });
    stamp.max(death).map(|ms| ms.saturating_add(999))
}

/// `props` with its `expiration` set to what is left of its time to live at `now_ms`: the
/// lower of its own and the queue's (`queue_ttl_ms`, the source queue's `x-message-ttl` or
/// policy), less the age it says it has. Unchanged when it says no time or has no TTL.
pub fn carried(props: BasicProperties, queue_ttl_ms: Option<u64>, now_ms: u64) -> BasicProperties {
    let Some(at) = said_at_ms(&props) else {
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

    fn dead_lettered_at(secs: u64) -> FieldTable {
        let mut entry = FieldTable::default();
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
    fn the_age_a_message_says_it_has_is_taken_off() {
        // Published 10 s ago with 60 s to live: 50 s left (less the second's rounding: 50.999).
        let p = BasicProperties::default()
            .with_timestamp(NOW / 1000 - 10)
            .with_expiration("60000".into());
        assert_eq!(expiration(&carried(p, None, NOW)).as_deref(), Some("50999"));
        // The queue's TTL is lower: it counts.
        let p = BasicProperties::default()
            .with_timestamp(NOW / 1000 - 10)
            .with_expiration("60000".into());
        assert_eq!(
            expiration(&carried(p, Some(30_000), NOW)).as_deref(),
            Some("20999")
        );
        // A retry queue: dead-lettered into it 4 s ago, published long before.
        let p = BasicProperties::default()
            .with_timestamp(NOW / 1000 - 3600)
            .with_headers(dead_lettered_at(NOW / 1000 - 4));
        assert_eq!(
            expiration(&carried(p, Some(5_000), NOW)).as_deref(),
            Some("1999")
        );
        // Past its time: due at once.
        let p = BasicProperties::default().with_timestamp(NOW / 1000 - 100);
        assert_eq!(
            expiration(&carried(p, Some(5_000), NOW)).as_deref(),
            Some("0")
        );
    }

    #[test]
    fn a_message_that_says_nothing_keeps_its_ttl() {
        let p = BasicProperties::default().with_expiration("60000".into());
        assert_eq!(
            expiration(&carried(p, Some(1_000), NOW)).as_deref(),
            Some("60000"),
            "no time said: counted again from arrival"
        );
        let p = BasicProperties::default().with_timestamp(NOW / 1000 - 10);
        assert_eq!(expiration(&carried(p, None, NOW)), None, "no TTL at all");
        // A timestamp in the future (another clock): no age.
        let p = BasicProperties::default()
            .with_timestamp(NOW / 1000 + 100)
            .with_expiration("60000".into());
        assert_eq!(expiration(&carried(p, None, NOW)).as_deref(), Some("60000"));
    }
}
