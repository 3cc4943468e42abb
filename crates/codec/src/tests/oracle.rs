//! amq-protocol as an independent oracle.
//!
//! For every method (amq-protocol covers all 71) and for content properties:
//! - encode with Warren, parse with amq-protocol, compare in amq-protocol's domain;
//! - generate with amq-protocol, decode with Warren, compare, and check that Warren
//!   re-encodes amq-protocol's bytes byte for byte.
//!
//! amq-protocol drops reserved fields (writing zeros), drops basic.qos prefetch-size,
//! keeps tables in a sorted map (last duplicate wins) and reads both `l` and `L` as
//! signed 64-bit; the comparisons below are made where those choices don't matter.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::basic::{gen_properties, parse_properties, AMQPProperties};
use amq_protocol::protocol::{
    access as aa, basic as ab, channel as ach, confirm as acf, connection as ac, exchange as ae,
    queue as aq, tx as at, AMQPClass,
};
use amq_protocol::types::generation::gen_field_table;
use amq_protocol::types::parsing::parse_field_table;
use amq_protocol::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable as AFieldTable, LongString,
    ShortString,
};
use bytes::{Bytes, BytesMut};
use proptest::prelude::*;

use crate::frame::{ContentHeader, Frame, FrameDecoder};
use crate::method::*;
use crate::properties::BasicProperties;
use crate::proptests::arb_properties;
use crate::strings::ShortStr;
use crate::table::{FieldTable, FieldValue};

/// Field conversion between the two codecs.
trait Conv<T> {
    fn to_amq(&self) -> T;
    fn from_amq(t: &T) -> Self;
}

macro_rules! conv_copy {
    ($($t:ty),*) => {$(
        impl Conv<$t> for $t {
            fn to_amq(&self) -> $t { *self }
            fn from_amq(t: &$t) -> $t { *t }
        }
    )*};
}
conv_copy!(u8, u16, u32, u64, bool);

impl Conv<ShortString> for ShortStr {
    fn to_amq(&self) -> ShortString {
        ShortString::from(self.as_str())
    }
    fn from_amq(t: &ShortString) -> ShortStr {
        ShortStr::try_from_str(t.as_str()).expect("shortstr from amq-protocol")
    }
}

impl Conv<LongString> for Bytes {
    fn to_amq(&self) -> LongString {
        LongString::from(self.to_vec())
    }
    fn from_amq(t: &LongString) -> Bytes {
        Bytes::copy_from_slice(t.as_bytes())
    }
}

impl Conv<AFieldTable> for FieldTable {
    fn to_amq(&self) -> AFieldTable {
        let mut t = AFieldTable::default();
        for (k, v) in self.iter() {
            t.insert(k.to_amq(), value_to_amq(v));
        }
        t
    }
    fn from_amq(t: &AFieldTable) -> FieldTable {
        t.inner()
            .iter()
            .map(|(k, v)| (ShortStr::from_amq(k), value_from_amq(v)))
            .collect()
    }
}

fn value_to_amq(v: &FieldValue) -> AMQPValue {
    match v {
        FieldValue::Bool(b) => AMQPValue::Boolean(*b),
        FieldValue::I8(x) => AMQPValue::ShortShortInt(*x),
        FieldValue::U8(x) => AMQPValue::ShortShortUInt(*x),
        FieldValue::I16(x) => AMQPValue::ShortInt(*x),
        FieldValue::U16(x) => AMQPValue::ShortUInt(*x),
        FieldValue::I32(x) => AMQPValue::LongInt(*x),
        FieldValue::U32(x) => AMQPValue::LongUInt(*x),
        FieldValue::I64(x) => AMQPValue::LongLongInt(*x),
        // RabbitMQ and amq-protocol both read 'L' as signed
        FieldValue::U64(x) => AMQPValue::LongLongInt(*x as i64),
        FieldValue::F32(x) => AMQPValue::Float(*x),
        FieldValue::F64(x) => AMQPValue::Double(*x),
        FieldValue::Decimal { scale, value } => AMQPValue::DecimalValue(DecimalValue {
            scale: *scale,
            value: *value,
        }),
        FieldValue::LongStr(b) => AMQPValue::LongString(b.to_amq()),
        FieldValue::ByteArray(b) => AMQPValue::ByteArray(ByteArray::from(b.to_vec())),
        FieldValue::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(value_to_amq).collect::<Vec<_>>(),
        )),
        FieldValue::Timestamp(t) => AMQPValue::Timestamp(*t),
        FieldValue::Table(t) => AMQPValue::FieldTable(t.to_amq()),
        FieldValue::Void => AMQPValue::Void,
    }
}

fn value_from_amq(v: &AMQPValue) -> FieldValue {
    match v {
        AMQPValue::Boolean(b) => FieldValue::Bool(*b),
        AMQPValue::ShortShortInt(x) => FieldValue::I8(*x),
        AMQPValue::ShortShortUInt(x) => FieldValue::U8(*x),
        AMQPValue::ShortInt(x) => FieldValue::I16(*x),
        AMQPValue::ShortUInt(x) => FieldValue::U16(*x),
        AMQPValue::LongInt(x) => FieldValue::I32(*x),
        AMQPValue::LongUInt(x) => FieldValue::U32(*x),
        AMQPValue::LongLongInt(x) => FieldValue::I64(*x),
        AMQPValue::Float(x) => FieldValue::F32(*x),
        AMQPValue::Double(x) => FieldValue::F64(*x),
        AMQPValue::DecimalValue(d) => FieldValue::Decimal {
            scale: d.scale,
            value: d.value,
        },
        AMQPValue::ShortString(s) => FieldValue::long_str(s.as_str()),
        AMQPValue::LongString(s) => FieldValue::LongStr(Bytes::from_amq(s)),
        AMQPValue::FieldArray(a) => {
            FieldValue::Array(a.as_slice().iter().map(value_from_amq).collect())
        }
        AMQPValue::Timestamp(t) => FieldValue::Timestamp(*t),
        AMQPValue::FieldTable(t) => FieldValue::Table(FieldTable::from_amq(t)),
        AMQPValue::ByteArray(b) => FieldValue::ByteArray(Bytes::copy_from_slice(b.as_slice())),
        AMQPValue::Void => FieldValue::Void,
    }
}

/// `ours => Class(module::Struct { our_field => their_field, ... })`
macro_rules! oracle_map {
    ($( $ours:ident => $class:ident($m:ident :: $st:ident { $($of:ident => $af:ident),* $(,)? }); )*) => {
        #[allow(unused_variables)]
        fn method_to_amq(m: &Method) -> AMQPClass {
            match m {
                $( Method::$ours(x) => AMQPClass::$class($m::AMQPMethod::$st($m::$st {
                    $( $af: Conv::to_amq(&x.$of), )*
                })), )*
            }
        }

    };
}

oracle_map! {
    ConnectionStart => Connection(ac::Start { version_major => version_major, version_minor => version_minor,
        server_properties => server_properties, mechanisms => mechanisms, locales => locales });
    ConnectionStartOk => Connection(ac::StartOk { client_properties => client_properties,
        mechanism => mechanism, response => response, locale => locale });
    ConnectionSecure => Connection(ac::Secure { challenge => challenge });
    ConnectionSecureOk => Connection(ac::SecureOk { response => response });
    ConnectionTune => Connection(ac::Tune { channel_max => channel_max, frame_max => frame_max, heartbeat => heartbeat });
    ConnectionTuneOk => Connection(ac::TuneOk { channel_max => channel_max, frame_max => frame_max, heartbeat => heartbeat });
    ConnectionOpen => Connection(ac::Open { virtual_host => virtual_host });
    ConnectionOpenOk => Connection(ac::OpenOk {});
    ConnectionClose => Connection(ac::Close { reply_code => reply_code, reply_text => reply_text,
        class_id => class_id, method_id => method_id });
    ConnectionCloseOk => Connection(ac::CloseOk {});
    ConnectionBlocked => Connection(ac::Blocked { reason => reason });
    ConnectionUnblocked => Connection(ac::Unblocked {});
    ConnectionUpdateSecret => Connection(ac::UpdateSecret { new_secret => new_secret, reason => reason });
    ConnectionUpdateSecretOk => Connection(ac::UpdateSecretOk {});
    ChannelOpen => Channel(ach::Open {});
    ChannelOpenOk => Channel(ach::OpenOk {});
    ChannelFlow => Channel(ach::Flow { active => active });
    ChannelFlowOk => Channel(ach::FlowOk { active => active });
    ChannelClose => Channel(ach::Close { reply_code => reply_code, reply_text => reply_text,
        class_id => class_id, method_id => method_id });
    ChannelCloseOk => Channel(ach::CloseOk {});
    AccessRequest => Access(aa::Request { realm => realm, exclusive => exclusive, passive => passive,
        active => active, write => write, read => read });
    AccessRequestOk => Access(aa::RequestOk {});
    ExchangeDeclare => Exchange(ae::Declare { exchange => exchange, kind => kind, passive => passive,
        durable => durable, auto_delete => auto_delete, internal => internal, no_wait => nowait,
        arguments => arguments });
    ExchangeDeclareOk => Exchange(ae::DeclareOk {});
    ExchangeDelete => Exchange(ae::Delete { exchange => exchange, if_unused => if_unused, no_wait => nowait });
    ExchangeDeleteOk => Exchange(ae::DeleteOk {});
    ExchangeBind => Exchange(ae::Bind { destination => destination, source => source,
        routing_key => routing_key, no_wait => nowait, arguments => arguments });
    ExchangeBindOk => Exchange(ae::BindOk {});
    ExchangeUnbind => Exchange(ae::Unbind { destination => destination, source => source,
        routing_key => routing_key, no_wait => nowait, arguments => arguments });
    ExchangeUnbindOk => Exchange(ae::UnbindOk {});
    QueueDeclare => Queue(aq::Declare { queue => queue, passive => passive, durable => durable,
        exclusive => exclusive, auto_delete => auto_delete, no_wait => nowait, arguments => arguments });
    QueueDeclareOk => Queue(aq::DeclareOk { queue => queue, message_count => message_count,
        consumer_count => consumer_count });
    QueueBind => Queue(aq::Bind { queue => queue, exchange => exchange, routing_key => routing_key,
        no_wait => nowait, arguments => arguments });
    QueueBindOk => Queue(aq::BindOk {});
    QueuePurge => Queue(aq::Purge { queue => queue, no_wait => nowait });
    QueuePurgeOk => Queue(aq::PurgeOk { message_count => message_count });
    QueueDelete => Queue(aq::Delete { queue => queue, if_unused => if_unused, if_empty => if_empty,
        no_wait => nowait });
    QueueDeleteOk => Queue(aq::DeleteOk { message_count => message_count });
    QueueUnbind => Queue(aq::Unbind { queue => queue, exchange => exchange, routing_key => routing_key,
        arguments => arguments });
    QueueUnbindOk => Queue(aq::UnbindOk {});
    BasicQos => Basic(ab::Qos { prefetch_count => prefetch_count, global => global });
    BasicQosOk => Basic(ab::QosOk {});
    BasicConsume => Basic(ab::Consume { queue => queue, consumer_tag => consumer_tag, no_local => no_local,
        no_ack => no_ack, exclusive => exclusive, no_wait => nowait, arguments => arguments });
    BasicConsumeOk => Basic(ab::ConsumeOk { consumer_tag => consumer_tag });
    BasicCancel => Basic(ab::Cancel { consumer_tag => consumer_tag, no_wait => nowait });
    BasicCancelOk => Basic(ab::CancelOk { consumer_tag => consumer_tag });
    BasicPublish => Basic(ab::Publish { exchange => exchange, routing_key => routing_key,
        mandatory => mandatory, immediate => immediate });
    BasicReturn => Basic(ab::Return { reply_code => reply_code, reply_text => reply_text,
        exchange => exchange, routing_key => routing_key });
    BasicDeliver => Basic(ab::Deliver { consumer_tag => consumer_tag, delivery_tag => delivery_tag,
        redelivered => redelivered, exchange => exchange, routing_key => routing_key });
    BasicGet => Basic(ab::Get { queue => queue, no_ack => no_ack });
    BasicGetOk => Basic(ab::GetOk { delivery_tag => delivery_tag, redelivered => redelivered,
        exchange => exchange, routing_key => routing_key, message_count => message_count });
    BasicGetEmpty => Basic(ab::GetEmpty {});
    BasicAck => Basic(ab::Ack { delivery_tag => delivery_tag, multiple => multiple });
    BasicReject => Basic(ab::Reject { delivery_tag => delivery_tag, requeue => requeue });
    BasicRecoverAsync => Basic(ab::RecoverAsync { requeue => requeue });
    BasicRecover => Basic(ab::Recover { requeue => requeue });
    BasicRecoverOk => Basic(ab::RecoverOk {});
    BasicNack => Basic(ab::Nack { delivery_tag => delivery_tag, multiple => multiple, requeue => requeue });
    ConfirmSelect => Confirm(acf::Select { no_wait => nowait });
    ConfirmSelectOk => Confirm(acf::SelectOk {});
    TxSelect => Tx(at::Select {});
    TxSelectOk => Tx(at::SelectOk {});
    TxCommit => Tx(at::Commit {});
    TxCommitOk => Tx(at::CommitOk {});
    TxRollback => Tx(at::Rollback {});
    TxRollbackOk => Tx(at::RollbackOk {});
}

fn props_to_amq(p: &BasicProperties) -> AMQPProperties {
    let mut a = AMQPProperties::default();
    if let Some(v) = &p.content_type {
        a = a.with_content_type(v.to_amq());
    }
    if let Some(v) = &p.content_encoding {
        a = a.with_content_encoding(v.to_amq());
    }
    if let Some(v) = &p.headers {
        a = a.with_headers(v.to_amq());
    }
    if let Some(v) = p.delivery_mode {
        a = a.with_delivery_mode(v);
    }
    if let Some(v) = p.priority {
        a = a.with_priority(v);
    }
    if let Some(v) = &p.correlation_id {
        a = a.with_correlation_id(v.to_amq());
    }
    if let Some(v) = &p.reply_to {
        a = a.with_reply_to(v.to_amq());
    }
    if let Some(v) = &p.expiration {
        a = a.with_expiration(v.to_amq());
    }
    if let Some(v) = &p.message_id {
        a = a.with_message_id(v.to_amq());
    }
    if let Some(v) = p.timestamp {
        a = a.with_timestamp(v);
    }
    if let Some(v) = &p.kind {
        a = a.with_type(v.to_amq());
    }
    if let Some(v) = &p.user_id {
        a = a.with_user_id(v.to_amq());
    }
    if let Some(v) = &p.app_id {
        a = a.with_app_id(v.to_amq());
    }
    if let Some(v) = &p.cluster_id {
        a = a.with_cluster_id(v.to_amq());
    }
    a
}

fn amq_gen(frame: &AMQPFrame) -> Vec<u8> {
    let ctx = gen_frame(frame)(WriteContext::from(Vec::new())).expect("amq-protocol gen_frame");
    ctx.write
}

fn amq_parse(bytes: &[u8]) -> AMQPFrame {
    let (rest, frame) = parse_frame(bytes).expect("amq-protocol parse_frame");
    assert!(rest.is_empty(), "amq-protocol left {} bytes", rest.len());
    frame
}

/// amq-protocol compares floats with `==`; the oracle avoids NaN.
fn no_nan_table(t: FieldTable) -> FieldTable {
    t.into_iter().map(|(k, v)| (k, no_nan(v))).collect()
}

fn no_nan(v: FieldValue) -> FieldValue {
    match v {
        FieldValue::F32(x) if x.is_nan() => FieldValue::F32(0.5),
        FieldValue::F64(x) if x.is_nan() => FieldValue::F64(0.25),
        FieldValue::Array(a) => FieldValue::Array(a.into_iter().map(no_nan).collect()),
        FieldValue::Table(t) => FieldValue::Table(no_nan_table(t)),
        other => other,
    }
}

fn no_nan_method(m: Method) -> Method {
    match m {
        Method::ConnectionStart(mut x) => {
            x.server_properties = no_nan_table(x.server_properties);
            Method::ConnectionStart(x)
        }
        Method::ConnectionStartOk(mut x) => {
            x.client_properties = no_nan_table(x.client_properties);
            Method::ConnectionStartOk(x)
        }
        Method::ExchangeDeclare(mut x) => {
            x.arguments = no_nan_table(x.arguments);
            Method::ExchangeDeclare(x)
        }
        Method::ExchangeBind(mut x) => {
            x.arguments = no_nan_table(x.arguments);
            Method::ExchangeBind(x)
        }
        Method::ExchangeUnbind(mut x) => {
            x.arguments = no_nan_table(x.arguments);
            Method::ExchangeUnbind(x)
        }
        Method::QueueDeclare(mut x) => {
            x.arguments = no_nan_table(x.arguments);
            Method::QueueDeclare(x)
        }
        Method::QueueBind(mut x) => {
            x.arguments = no_nan_table(x.arguments);
            Method::QueueBind(x)
        }
        Method::QueueUnbind(mut x) => {
            x.arguments = no_nan_table(x.arguments);
            Method::QueueUnbind(x)
        }
        Method::BasicConsume(mut x) => {
            x.arguments = no_nan_table(x.arguments);
            Method::BasicConsume(x)
        }
        other => other,
    }
}

fn no_nan_props(mut p: BasicProperties) -> BasicProperties {
    p.headers = p.headers.map(no_nan_table);
    p
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    /// Warren encodes, amq-protocol parses: same method and field values.
    #[test]
    fn ours_to_amq_protocol(m in Method::arbitrary().prop_map(no_nan_method), channel in any::<u16>()) {
        let mut out = BytesMut::new();
        crate::encode_method(&mut out, channel, &m);
        match amq_parse(&out) {
            AMQPFrame::Method(ch, class) => {
                prop_assert_eq!(ch, channel);
                prop_assert_eq!(class, method_to_amq(&m));
            }
            other => prop_assert!(false, "unexpected frame {:?}", other),
        }
    }

    /// amq-protocol generates, Warren decodes the same values and re-encodes the very
    /// same bytes.
    #[test]
    fn amq_protocol_to_ours(m in Method::arbitrary().prop_map(no_nan_method), channel in any::<u16>()) {
        let class = method_to_amq(&m);
        let bytes = amq_gen(&AMQPFrame::Method(channel, class.clone()));
        let mut buf = BytesMut::from(&bytes[..]);
        let frame = FrameDecoder::new(0).decode(&mut buf).unwrap().unwrap();
        prop_assert!(buf.is_empty());
        let Frame::Method { channel: ch, method } = &frame else {
            return Err(TestCaseError::fail(format!("unexpected frame {frame:?}")));
        };
        prop_assert_eq!(*ch, channel);
        prop_assert_eq!(method_to_amq(method), class.clone());
        let mut again = BytesMut::new();
        frame.encode(&mut again);
        prop_assert_eq!(&again[..], &bytes[..]);
    }

    /// Content headers and properties, both ways.
    #[test]
    fn properties_both_ways(p in arb_properties().prop_map(no_nan_props), body_size in any::<u64>(), channel in any::<u16>()) {
        // ours -> amq-protocol
        let raw = p.encode();
        let (rest, parsed) = parse_properties(&raw[..]).expect("amq-protocol parse_properties");
        prop_assert!(rest.is_empty());
        prop_assert_eq!(&parsed, &props_to_amq(&p));
        let mut out = BytesMut::new();
        Frame::Header {
            channel,
            header: ContentHeader { class_id: 60, weight: 0, body_size, properties: raw.clone() },
        }
        .encode(&mut out);
        match amq_parse(&out) {
            AMQPFrame::Header(ch, h) => {
                prop_assert_eq!(ch, channel);
                prop_assert_eq!(h.class_id, 60);
                prop_assert_eq!(h.body_size, body_size);
                prop_assert_eq!(h.properties, props_to_amq(&p));
            }
            other => prop_assert!(false, "unexpected frame {:?}", other),
        }
        // amq-protocol -> ours
        let a = props_to_amq(&p);
        let generated = gen_properties(&a)(WriteContext::from(Vec::new())).expect("gen_properties").write;
        let decoded = BasicProperties::decode(&generated).unwrap();
        prop_assert_eq!(props_to_amq(&decoded), a.clone());
        prop_assert_eq!(&decoded.encode()[..], &generated[..]);
        let frame = AMQPFrame::Header(channel, AMQPContentHeader { class_id: 60, body_size, properties: a });
        let bytes = amq_gen(&frame);
        let mut buf = BytesMut::from(&bytes[..]);
        match FrameDecoder::new(0).decode(&mut buf).unwrap() {
            Some(Frame::Header { channel: ch, header }) => {
                prop_assert_eq!(ch, channel);
                prop_assert_eq!(header.body_size, body_size);
                prop_assert_eq!(&header.properties[..], &generated[..]);
            }
            other => prop_assert!(false, "unexpected frame {:?}", other),
        }
    }

    /// Field tables of every type, both ways.
    #[test]
    fn tables_both_ways(t in crate::testing::arb_table().prop_map(no_nan_table)) {
        let ours = t.to_bytes();
        let (rest, parsed) = parse_field_table(&ours[..]).expect("amq-protocol parse_field_table");
        prop_assert!(rest.is_empty());
        prop_assert_eq!(&parsed, &t.to_amq());
        let theirs = gen_field_table(&parsed)(WriteContext::from(Vec::new())).expect("gen_field_table").write;
        let decoded = FieldTable::decode(&mut Bytes::from(theirs.clone())).unwrap();
        prop_assert_eq!(&decoded, &FieldTable::from_amq(&parsed));
        prop_assert_eq!(&decoded.to_bytes()[..], &theirs[..]);
    }

    /// Body and heartbeat frames from amq-protocol.
    #[test]
    fn bodies_from_amq_protocol(body in proptest::collection::vec(any::<u8>(), 0..2000), channel in any::<u16>()) {
        let mut all = amq_gen(&AMQPFrame::Body(channel, body.clone()));
        all.extend(amq_gen(&AMQPFrame::Heartbeat));
        let mut buf = BytesMut::from(&all[..]);
        let mut dec = FrameDecoder::new(0);
        prop_assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(Frame::Body { channel, payload: Bytes::from(body) })
        );
        prop_assert_eq!(dec.decode(&mut buf).unwrap(), Some(Frame::Heartbeat { channel: 0 }));
    }
}

#[test]
fn deliver_encoder_matches_amq_protocol() {
    let props = AMQPProperties::default().with_delivery_mode(2);
    let mut ours = BytesMut::new();
    let raw = gen_properties(&props)(WriteContext::from(Vec::new()))
        .expect("gen_properties")
        .write;
    crate::encode_deliver(
        &mut ours, 3, "ctag", 77, true, "ex", "rk", &raw, b"hello", 4096,
    );
    let mut theirs = amq_gen(&AMQPFrame::Method(
        3,
        AMQPClass::Basic(ab::AMQPMethod::Deliver(ab::Deliver {
            consumer_tag: "ctag".into(),
            delivery_tag: 77,
            redelivered: true,
            exchange: "ex".into(),
            routing_key: "rk".into(),
        })),
    ));
    theirs.extend(amq_gen(&AMQPFrame::Header(
        3,
        AMQPContentHeader {
            class_id: 60,
            body_size: 5,
            properties: props,
        },
    )));
    theirs.extend(amq_gen(&AMQPFrame::Body(3, b"hello".to_vec())));
    assert_eq!(&ours[..], &theirs[..]);
}
