//! Every AMQP 0-9-1 method plus RabbitMQ's extensions, one struct per method.
//!
//! Field names follow the 0-9-1 XML in snake_case, with these exceptions:
//! `exchange.declare`'s `type` is `kind`, `nowait` is `no_wait`, and the bits the 0-9-1
//! XML calls `reserved-2`/`reserved-3` in `exchange.declare` are `auto_delete` and
//! `internal` (RabbitMQ's names; it honours both). Other reserved fields are
//! `reserved_1`, `reserved_2` (`ticket` is `reserved_1`) and round-trip as received.
//!
//! Types: octet `u8`, short `u16`, long `u32`, longlong `u64`, shortstr [`ShortStr`],
//! longstr [`Bytes`], bit `bool` (consecutive bits packed into one octet), table
//! [`FieldTable`] (no 0-9-1 method has a timestamp argument).

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::CodecError;
use crate::strings::ShortStr;
use crate::table::FieldTable;
use crate::wire::{get_u16, Reader, Writer};

macro_rules! field_ty {
    (octet) => {
        u8
    };
    (short) => {
        u16
    };
    (long) => {
        u32
    };
    (longlong) => {
        u64
    };
    (bit) => {
        bool
    };
    (shortstr) => {
        ShortStr
    };
    (longstr) => {
        Bytes
    };
    (table) => {
        FieldTable
    };
}

macro_rules! method_struct {
    ($name:ident, $text:literal, {}) => {
        #[doc = concat!("`", $text, "` (no arguments).")]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        pub struct $name;

        #[cfg(test)]
        impl $name {
            pub(crate) fn arbitrary() -> proptest::strategy::BoxedStrategy<Method> {
                use proptest::strategy::Strategy;
                proptest::strategy::Just(Method::$name($name)).boxed()
            }
        }
    };
    ($name:ident, $text:literal, { $($field:ident : $kind:ident),+ }) => {
        #[doc = concat!("`", $text, "`.")]
        #[derive(Clone, Debug, Default, PartialEq)]
        pub struct $name {
            $(
                #[doc = concat!("`", stringify!($kind), "`")]
                pub $field: field_ty!($kind),
            )+
        }

        #[cfg(test)]
        impl $name {
            pub(crate) fn arbitrary() -> proptest::strategy::BoxedStrategy<Method> {
                use proptest::strategy::Strategy;
                ( $( <field_ty!($kind) as crate::testing::Arb>::arb(), )+ )
                    .prop_map(|( $($field,)+ )| Method::$name($name { $($field),+ }))
                    .boxed()
            }
        }
    };
}

macro_rules! methods {
    ($( $class:literal, $id:literal, $name:ident, $text:literal, { $($field:ident : $kind:ident),* $(,)? } ;)*) => {
        $(
            method_struct!($name, $text, { $($field : $kind),* });

            impl $name {
                pub const CLASS_ID: u16 = $class;
                pub const METHOD_ID: u16 = $id;
                pub const NAME: &'static str = $text;

                #[allow(unused_variables)]
                #[inline]
                fn decode_args(r: &mut Reader) -> Result<Self, CodecError> {
                    Ok($name { $($field: r.$kind()?),* })
                }

                #[allow(unused_variables)]
                #[inline]
                fn encode_args(&self, w: &mut Writer<'_>) {
                    $( w.$kind(&self.$field); )*
                }
            }

            impl From<$name> for Method {
                fn from(m: $name) -> Method {
                    Method::$name(m)
                }
            }
        )*

        /// Any AMQP 0-9-1 method (plus RabbitMQ's extensions).
        #[derive(Clone, Debug, PartialEq)]
        pub enum Method {
            $( $name($name), )*
        }

        impl Method {
            pub fn class_id(&self) -> u16 {
                match self { $( Method::$name(_) => $class, )* }
            }

            pub fn method_id(&self) -> u16 {
                match self { $( Method::$name(_) => $id, )* }
            }

            /// The spec's name, e.g. `"basic.publish"`, `"connection.start-ok"`.
            pub fn name(&self) -> &'static str {
                match self { $( Method::$name(_) => $text, )* }
            }

            /// Decodes a method frame payload (starting at the class id). Strings and
            /// longstrs are zero-copy slices of `payload`. Argument errors come back as
            /// [`CodecError::BadMethodArgs`] carrying the class and method ids; bytes
            /// after the last argument are an error, as in RabbitMQ.
            pub fn decode(payload: Bytes) -> Result<Method, CodecError> {
                let mut p = payload;
                let class_id = get_u16(&mut p)?;
                let method_id = get_u16(&mut p)?;
                let args = p.clone();
                let mut r = Reader::new(p);
                let decoded = match (class_id, method_id) {
                    $( ($class, $id) => $name::decode_args(&mut r).map(Method::$name), )*
                    _ => return Err(CodecError::UnknownMethod { class_id, method_id }),
                };
                let method = decoded.map_err(|e| e.in_method(class_id, method_id, args.clone()))?;
                if r.remaining() != 0 {
                    return Err(CodecError::TrailingBytes(r.remaining())
                        .in_method(class_id, method_id, args));
                }
                Ok(method)
            }

            /// Appends the method frame payload (class id, method id, arguments).
            pub fn encode(&self, out: &mut BytesMut) {
                out.put_u16(self.class_id());
                out.put_u16(self.method_id());
                let mut w = Writer::new(out);
                match self { $( Method::$name(m) => m.encode_args(&mut w), )* }
            }

            #[cfg(test)]
            pub(crate) fn arbitrary() -> proptest::strategy::BoxedStrategy<Method> {
                use proptest::strategy::Strategy;
                proptest::strategy::Union::new(vec![ $( $name::arbitrary(), )* ]).boxed()
            }

            #[cfg(test)]
            pub(crate) const ALL_IDS: &'static [(u16, u16)] = &[ $( ($class, $id), )* ];
        }

        /// The name of a method by ids, `"unknown"` if there is none.
        pub fn method_name(class_id: u16, method_id: u16) -> &'static str {
            match (class_id, method_id) {
                $( ($class, $id) => $text, )*
                _ => "unknown",
            }
        }
    };
}

methods! {
    10, 10, ConnectionStart, "connection.start", {
        version_major: octet, version_minor: octet, server_properties: table,
        mechanisms: longstr, locales: longstr,
    };
    10, 11, ConnectionStartOk, "connection.start-ok", {
        client_properties: table, mechanism: shortstr, response: longstr, locale: shortstr,
    };
    10, 20, ConnectionSecure, "connection.secure", { challenge: longstr };
    10, 21, ConnectionSecureOk, "connection.secure-ok", { response: longstr };
    10, 30, ConnectionTune, "connection.tune", {
        channel_max: short, frame_max: long, heartbeat: short,
    };
    10, 31, ConnectionTuneOk, "connection.tune-ok", {
        channel_max: short, frame_max: long, heartbeat: short,
    };
    10, 40, ConnectionOpen, "connection.open", {
        virtual_host: shortstr, reserved_1: shortstr, reserved_2: bit,
    };
    10, 41, ConnectionOpenOk, "connection.open-ok", { reserved_1: shortstr };
    10, 50, ConnectionClose, "connection.close", {
        reply_code: short, reply_text: shortstr, class_id: short, method_id: short,
    };
    10, 51, ConnectionCloseOk, "connection.close-ok", {};
    10, 60, ConnectionBlocked, "connection.blocked", { reason: shortstr };
    10, 61, ConnectionUnblocked, "connection.unblocked", {};
    10, 70, ConnectionUpdateSecret, "connection.update-secret", {
        new_secret: longstr, reason: shortstr,
    };
    10, 71, ConnectionUpdateSecretOk, "connection.update-secret-ok", {};

    20, 10, ChannelOpen, "channel.open", { reserved_1: shortstr };
    20, 11, ChannelOpenOk, "channel.open-ok", { reserved_1: longstr };
    20, 20, ChannelFlow, "channel.flow", { active: bit };
    20, 21, ChannelFlowOk, "channel.flow-ok", { active: bit };
    20, 40, ChannelClose, "channel.close", {
        reply_code: short, reply_text: shortstr, class_id: short, method_id: short,
    };
    20, 41, ChannelCloseOk, "channel.close-ok", {};

    30, 10, AccessRequest, "access.request", {
        realm: shortstr, exclusive: bit, passive: bit, active: bit, write: bit, read: bit,
    };
    30, 11, AccessRequestOk, "access.request-ok", { reserved_1: short };

    40, 10, ExchangeDeclare, "exchange.declare", {
        reserved_1: short, exchange: shortstr, kind: shortstr, passive: bit, durable: bit,
        auto_delete: bit, internal: bit, no_wait: bit, arguments: table,
    };
    40, 11, ExchangeDeclareOk, "exchange.declare-ok", {};
    40, 20, ExchangeDelete, "exchange.delete", {
        reserved_1: short, exchange: shortstr, if_unused: bit, no_wait: bit,
    };
    40, 21, ExchangeDeleteOk, "exchange.delete-ok", {};
    40, 30, ExchangeBind, "exchange.bind", {
        reserved_1: short, destination: shortstr, source: shortstr, routing_key: shortstr,
        no_wait: bit, arguments: table,
    };
    40, 31, ExchangeBindOk, "exchange.bind-ok", {};
    40, 40, ExchangeUnbind, "exchange.unbind", {
        reserved_1: short, destination: shortstr, source: shortstr, routing_key: shortstr,
        no_wait: bit, arguments: table,
    };
    40, 51, ExchangeUnbindOk, "exchange.unbind-ok", {};

    50, 10, QueueDeclare, "queue.declare", {
        reserved_1: short, queue: shortstr, passive: bit, durable: bit, exclusive: bit,
        auto_delete: bit, no_wait: bit, arguments: table,
    };
    50, 11, QueueDeclareOk, "queue.declare-ok", {
        queue: shortstr, message_count: long, consumer_count: long,
    };
    50, 20, QueueBind, "queue.bind", {
        reserved_1: short, queue: shortstr, exchange: shortstr, routing_key: shortstr,
        no_wait: bit, arguments: table,
    };
    50, 21, QueueBindOk, "queue.bind-ok", {};
    50, 30, QueuePurge, "queue.purge", { reserved_1: short, queue: shortstr, no_wait: bit };
    50, 31, QueuePurgeOk, "queue.purge-ok", { message_count: long };
    50, 40, QueueDelete, "queue.delete", {
        reserved_1: short, queue: shortstr, if_unused: bit, if_empty: bit, no_wait: bit,
    };
    50, 41, QueueDeleteOk, "queue.delete-ok", { message_count: long };
    50, 50, QueueUnbind, "queue.unbind", {
        reserved_1: short, queue: shortstr, exchange: shortstr, routing_key: shortstr,
        arguments: table,
    };
    50, 51, QueueUnbindOk, "queue.unbind-ok", {};

    60, 10, BasicQos, "basic.qos", { prefetch_size: long, prefetch_count: short, global: bit };
    60, 11, BasicQosOk, "basic.qos-ok", {};
    60, 20, BasicConsume, "basic.consume", {
        reserved_1: short, queue: shortstr, consumer_tag: shortstr, no_local: bit, no_ack: bit,
        exclusive: bit, no_wait: bit, arguments: table,
    };
    60, 21, BasicConsumeOk, "basic.consume-ok", { consumer_tag: shortstr };
    60, 30, BasicCancel, "basic.cancel", { consumer_tag: shortstr, no_wait: bit };
    60, 31, BasicCancelOk, "basic.cancel-ok", { consumer_tag: shortstr };
    60, 40, BasicPublish, "basic.publish", {
        reserved_1: short, exchange: shortstr, routing_key: shortstr, mandatory: bit,
        immediate: bit,
    };
    60, 50, BasicReturn, "basic.return", {
        reply_code: short, reply_text: shortstr, exchange: shortstr, routing_key: shortstr,
    };
    60, 60, BasicDeliver, "basic.deliver", {
        consumer_tag: shortstr, delivery_tag: longlong, redelivered: bit, exchange: shortstr,
        routing_key: shortstr,
    };
    60, 70, BasicGet, "basic.get", { reserved_1: short, queue: shortstr, no_ack: bit };
    60, 71, BasicGetOk, "basic.get-ok", {
        delivery_tag: longlong, redelivered: bit, exchange: shortstr, routing_key: shortstr,
        message_count: long,
    };
    60, 72, BasicGetEmpty, "basic.get-empty", { reserved_1: shortstr };
    60, 80, BasicAck, "basic.ack", { delivery_tag: longlong, multiple: bit };
    60, 90, BasicReject, "basic.reject", { delivery_tag: longlong, requeue: bit };
    60, 100, BasicRecoverAsync, "basic.recover-async", { requeue: bit };
    60, 110, BasicRecover, "basic.recover", { requeue: bit };
    60, 111, BasicRecoverOk, "basic.recover-ok", {};
    60, 120, BasicNack, "basic.nack", { delivery_tag: longlong, multiple: bit, requeue: bit };

    85, 10, ConfirmSelect, "confirm.select", { no_wait: bit };
    85, 11, ConfirmSelectOk, "confirm.select-ok", {};

    90, 10, TxSelect, "tx.select", {};
    90, 11, TxSelectOk, "tx.select-ok", {};
    90, 20, TxCommit, "tx.commit", {};
    90, 21, TxCommitOk, "tx.commit-ok", {};
    90, 30, TxRollback, "tx.rollback", {};
    90, 31, TxRollbackOk, "tx.rollback-ok", {};
}

impl Method {
    /// True for the methods followed by content (a header frame and body frames):
    /// basic.publish, basic.return, basic.deliver, basic.get-ok.
    pub fn has_content(&self) -> bool {
        matches!(
            self,
            Method::BasicPublish(_)
                | Method::BasicReturn(_)
                | Method::BasicDeliver(_)
                | Method::BasicGetOk(_)
        )
    }

    /// `(class_id, method_id)`.
    pub fn ids(&self) -> (u16, u16) {
        (self.class_id(), self.method_id())
    }
}

/// The class ids of AMQP 0-9-1.
pub mod class {
    pub const CONNECTION: u16 = 10;
    pub const CHANNEL: u16 = 20;
    pub const ACCESS: u16 = 30;
    pub const EXCHANGE: u16 = 40;
    pub const QUEUE: u16 = 50;
    pub const BASIC: u16 = 60;
    pub const CONFIRM: u16 = 85;
    pub const TX: u16 = 90;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(m: &Method) -> Bytes {
        let mut out = BytesMut::new();
        m.encode(&mut out);
        let bytes = out.freeze();
        let back = Method::decode(bytes.clone()).unwrap();
        assert_eq!(&back, m);
        bytes
    }

    #[test]
    fn queue_declare_bits() {
        let m = Method::from(QueueDeclare {
            queue: "q".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: true,
            no_wait: true,
            ..Default::default()
        });
        let b = round_trip(&m);
        // class, method, reserved_1, "q", one bits octet, empty table
        assert_eq!(&b[..], &[0, 50, 0, 10, 0, 0, 1, b'q', 0b11010, 0, 0, 0, 0]);
        assert_eq!(m.name(), "queue.declare");
        assert_eq!((m.class_id(), m.method_id()), (50, 10));
    }

    #[test]
    fn basic_consume_bits() {
        let m = Method::from(BasicConsume {
            queue: "q".into(),
            consumer_tag: "t".into(),
            no_local: true,
            no_ack: false,
            exclusive: true,
            no_wait: false,
            ..Default::default()
        });
        let b = round_trip(&m);
        assert_eq!(
            &b[..],
            &[0, 60, 0, 20, 0, 0, 1, b'q', 1, b't', 0b0101, 0, 0, 0, 0]
        );
    }

    #[test]
    fn bits_separated_by_other_fields_use_separate_octets() {
        let m = Method::from(BasicDeliver {
            consumer_tag: "c".into(),
            delivery_tag: 7,
            redelivered: true,
            exchange: "".into(),
            routing_key: "rk".into(),
        });
        let b = round_trip(&m);
        assert_eq!(
            &b[..],
            &[0, 60, 0, 60, 1, b'c', 0, 0, 0, 0, 0, 0, 0, 7, 1, 0, 2, b'r', b'k']
        );
        let m = Method::from(BasicNack {
            delivery_tag: 1,
            multiple: false,
            requeue: true,
        });
        let b = round_trip(&m);
        assert_eq!(b.last(), Some(&0b10));
        // exchange.declare: 5 bits in one octet
        let m = Method::from(ExchangeDeclare {
            exchange: "x".into(),
            kind: "topic".into(),
            passive: true,
            durable: false,
            auto_delete: false,
            internal: true,
            no_wait: true,
            ..Default::default()
        });
        let b = round_trip(&m);
        assert_eq!(b.get(b.len() - 5), Some(&0b11001));
    }

    #[test]
    fn errors_carry_ids() {
        // basic.publish cut short
        let e = Method::decode(Bytes::from_static(&[0, 60, 0, 40, 0, 0, 5, b'a'])).unwrap_err();
        assert_eq!(e.class_method(), (60, 40));
        assert!(
            matches!(e, CodecError::BadMethodArgs { ref cause, .. } if **cause == CodecError::Truncated)
        );
        // trailing byte after basic.ack
        let e = Method::decode(Bytes::from_static(&[
            0, 60, 0, 80, 0, 0, 0, 0, 0, 0, 0, 1, 0, 9,
        ]))
        .unwrap_err();
        assert_eq!(e.class_method(), (60, 80));
        assert!(
            matches!(e, CodecError::BadMethodArgs { ref cause, .. } if **cause == CodecError::TrailingBytes(1))
        );
        // unknown method
        let e = Method::decode(Bytes::from_static(&[0, 60, 0, 99])).unwrap_err();
        assert_eq!(
            e,
            CodecError::UnknownMethod {
                class_id: 60,
                method_id: 99
            }
        );
        assert_eq!(e.reply_code(), crate::ReplyCode::NotImplemented);
        // too short for the ids
        assert_eq!(
            Method::decode(Bytes::from_static(&[0, 60, 0])),
            Err(CodecError::Truncated)
        );
        // bad UTF-8 in a shortstr
        let e = Method::decode(Bytes::from_static(&[0, 20, 0, 10, 1, 0xff])).unwrap_err();
        assert!(
            matches!(e, CodecError::BadMethodArgs { ref cause, .. } if **cause == CodecError::InvalidUtf8)
        );
    }

    #[test]
    fn zero_copy_strings() {
        let mut out = BytesMut::new();
        Method::from(BasicPublish {
            exchange: "amq.topic".into(),
            routing_key: "a.b.c".into(),
            ..Default::default()
        })
        .encode(&mut out);
        let payload = out.freeze();
        let range = payload.as_ptr() as usize..payload.as_ptr() as usize + payload.len();
        match Method::decode(payload.clone()).unwrap() {
            Method::BasicPublish(p) => {
                assert!(range.contains(&(p.exchange.as_ptr() as usize)));
                assert!(range.contains(&(p.routing_key.as_ptr() as usize)));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn names_and_ids_are_unique() {
        let mut ids = Method::ALL_IDS.to_vec();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), Method::ALL_IDS.len());
        assert_eq!(method_name(60, 40), "basic.publish");
        assert_eq!(method_name(40, 51), "exchange.unbind-ok");
        assert_eq!(method_name(1, 1), "unknown");
        for &(c, m) in Method::ALL_IDS {
            assert_ne!(method_name(c, m), "unknown");
        }
    }
}
