//! Proptest strategies shared by the unit and property tests.

use bytes::Bytes;
use proptest::collection::vec;
use proptest::prelude::*;

use crate::strings::ShortStr;
use crate::table::{FieldTable, FieldValue};

/// A strategy for any value of a method field type.
pub(crate) trait Arb: Sized {
    fn arb() -> BoxedStrategy<Self>;
}

macro_rules! arb_any {
    ($($t:ty),*) => {$(
        impl Arb for $t {
            fn arb() -> BoxedStrategy<Self> {
                any::<$t>().boxed()
            }
        }
    )*};
}
arb_any!(u8, u16, u32, u64, bool);

impl Arb for ShortStr {
    fn arb() -> BoxedStrategy<Self> {
        arb_shortstr().boxed()
    }
}

impl Arb for Bytes {
    fn arb() -> BoxedStrategy<Self> {
        arb_longstr().boxed()
    }
}

impl Arb for FieldTable {
    fn arb() -> BoxedStrategy<Self> {
        arb_table().boxed()
    }
}

pub(crate) fn arb_shortstr() -> impl Strategy<Value = ShortStr> {
    prop_oneof![
        4 => "[a-zA-Z0-9._-]{0,16}",
        2 => "\\PC{0,40}",
        1 => "[a-z]{250,255}",
    ]
    .prop_map(ShortStr::from_string)
}

pub(crate) fn arb_longstr() -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..48).prop_map(Bytes::from)
}

pub(crate) fn arb_leaf() -> impl Strategy<Value = FieldValue> {
    prop_oneof![
        any::<bool>().prop_map(FieldValue::Bool),
        any::<i8>().prop_map(FieldValue::I8),
        any::<u8>().prop_map(FieldValue::U8),
        any::<i16>().prop_map(FieldValue::I16),
        any::<u16>().prop_map(FieldValue::U16),
        any::<i32>().prop_map(FieldValue::I32),
        any::<u32>().prop_map(FieldValue::U32),
        any::<i64>().prop_map(FieldValue::I64),
        any::<u64>().prop_map(FieldValue::U64),
        any::<f32>().prop_map(FieldValue::F32),
        any::<f64>().prop_map(FieldValue::F64),
        (any::<u8>(), any::<u32>()).prop_map(|(scale, value)| FieldValue::Decimal { scale, value }),
        arb_longstr().prop_map(FieldValue::LongStr),
        arb_longstr().prop_map(FieldValue::ByteArray),
        any::<u64>().prop_map(FieldValue::Timestamp),
        Just(FieldValue::Void),
    ]
}

pub(crate) fn arb_value() -> impl Strategy<Value = FieldValue> {
    arb_leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(FieldValue::Array),
            vec((arb_key(), inner), 0..6).prop_map(|v| FieldValue::Table(FieldTable(v))),
        ]
    })
}

/// Keys from a small alphabet, so duplicates are common.
pub(crate) fn arb_key() -> impl Strategy<Value = ShortStr> {
    prop_oneof![
        3 => "[a-c]{1,2}",
        1 => "x-[a-z-]{1,20}",
        1 => "\\PC{0,12}",
    ]
    .prop_map(ShortStr::from_string)
}

pub(crate) fn arb_table() -> impl Strategy<Value = FieldTable> {
    vec((arb_key(), arb_value()), 0..8).prop_map(FieldTable)
}
