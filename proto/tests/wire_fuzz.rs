//! Property tests of wire decoding: any tensor a peer can send decodes to an
//! error or to exactly rows × cols finite-checked values, never a panic; and
//! finite values survive an encode/decode round trip (within the dtype).

use epserve_proto::Bytes;
use epserve_proto::pb::{Dtype, Tensor};
use epserve_proto::wire;
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = i32> {
    prop_oneof![
        Just(Dtype::F32 as i32),
        Just(Dtype::Bf16 as i32),
        Just(Dtype::Int8 as i32),
        any::<i32>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn hostile_tensors_never_panic(
        dtype in dtype(),
        rows in prop_oneof![0u32..8, any::<u32>()],
        cols in prop_oneof![0u32..8, any::<u32>()],
        data in proptest::collection::vec(any::<u8>(), 0..256),
        scales in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let t = Tensor { dtype, rows, cols, data: Bytes::from(data), scales: Bytes::from(scales) };
        if let Ok(d) = wire::decode_rows_finite(&t) {
            prop_assert_eq!(d.values.len(), rows as usize * cols as usize);
            prop_assert!(d.values.iter().all(|v| v.is_finite()));
        }
        let _ = wire::decode_rows(&t);
    }

    #[test]
    fn finite_values_round_trip(
        rows in 0usize..6,
        cols in 0usize..9,
        seed in proptest::collection::vec(-1.0e6f32..1.0e6, 54),
        which in 0usize..3,
    ) {
        let x: Vec<f32> = seed.iter().copied().take(rows * cols).collect();
        prop_assume!(x.len() == rows * cols);
        let dt = [Dtype::F32, Dtype::Bf16, Dtype::Int8][which];
        let t = wire::encode(&x, rows, cols, dt);
        let d = wire::decode_rows_finite(&t);
        prop_assert!(d.is_ok(), "{:?}", d.err());
        let d = d.map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(d.values.len(), x.len());
        if dt == Dtype::F32 {
            prop_assert_eq!(&d.values, &x);
        }
    }

    #[test]
    fn nan_and_inf_are_refused(
        pos in 0usize..12,
        bad in prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)],
        which in 0usize..2,
    ) {
        let mut x = vec![0.5f32; 12];
        x[pos] = bad;
        let dt = [Dtype::F32, Dtype::Bf16][which];
        let t = wire::encode(&x, 3, 4, dt);
        prop_assert!(wire::decode_rows_finite(&t).is_err());
    }
}
