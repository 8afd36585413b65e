//! One conformance suite every [`KvStore`] backend must pass (GreptimeDB's
//! `kv_backend` tests, same idea): the in-memory store runs it in this crate's
//! unit tests, a real etcd in `tests/tests/store.rs` (part of the test
//! command). Each case works under its own key prefix, so a shared etcd stays
//! usable, and panics with a message naming the case and the property.
//!
//! Test support: nothing in the serving path calls it.

use std::time::Duration;

use super::{KvStore, StoreResult};

/// Runs every case against `store`, under keys starting with `prefix`
/// (e.g. `/conformance/<unique>/`).
pub async fn run_all(store: &dyn KvStore, prefix: &str) -> StoreResult<()> {
    get_put_delete(store, &format!("{prefix}get/")).await?;
    create_only_once(store, &format!("{prefix}create/")).await?;
    compare_and_swap(store, &format!("{prefix}cas/")).await?;
    list_by_prefix(store, &format!("{prefix}list/")).await?;
    leased_keys(store, &format!("{prefix}lease/")).await?;
    watch_sees_every_change(store, &format!("{prefix}watch/")).await?;
    Ok(())
}

/// A missing key reads as `None`; `put` writes and overwrites with a newer
/// revision; `delete` removes, and deleting a missing key is not an error.
pub async fn get_put_delete(s: &dyn KvStore, p: &str) -> StoreResult<()> {
    let k = format!("{p}k");
    assert_eq!(
        s.get(&k).await?,
        None,
        "get_put_delete: a missing key reads as None"
    );
    s.put(&k, b"1".to_vec()).await?;
    let v1 = s
        .get(&k)
        .await?
        .expect("get_put_delete: a put key reads back");
    assert_eq!(v1.value, b"1", "get_put_delete: value read back");
    s.put(&k, b"2".to_vec()).await?;
    let v2 = s
        .get(&k)
        .await?
        .expect("get_put_delete: an overwritten key reads back");
    assert_eq!(v2.value, b"2", "get_put_delete: the overwrite wins");
    assert!(
        v2.mod_revision > v1.mod_revision,
        "get_put_delete: an overwrite raises the mod revision ({} -> {})",
        v1.mod_revision,
        v2.mod_revision
    );
    s.delete(&k).await?;
    assert_eq!(
        s.get(&k).await?,
        None,
        "get_put_delete: a deleted key reads as None"
    );
    s.delete(&k).await?;
    Ok(())
}

/// `create` writes only a key that does not exist, and says whether it did.
pub async fn create_only_once(s: &dyn KvStore, p: &str) -> StoreResult<()> {
    let k = format!("{p}k");
    assert!(
        s.create(&k, b"first".to_vec()).await?,
        "create: a new key is created"
    );
    assert!(
        !s.create(&k, b"second".to_vec()).await?,
        "create: an existing key is not created again"
    );
    let v = s
        .get(&k)
        .await?
        .expect("create: the created key reads back");
    assert_eq!(
        v.value, b"first",
        "create: a refused create changes nothing"
    );
    s.delete(&k).await?;
    assert!(
        s.create(&k, b"again".to_vec()).await?,
        "create: a deleted key can be created again"
    );
    Ok(())
}

/// `compare_and_swap` writes only at the key's current mod revision; a
/// missing key has revision 0 (etcd's semantics), so CAS at 0 creates it.
pub async fn compare_and_swap(s: &dyn KvStore, p: &str) -> StoreResult<()> {
    let k = format!("{p}k");
    assert!(
        !s.compare_and_swap(&k, 12345, b"x".to_vec()).await?,
        "cas: a missing key does not match a nonzero revision"
    );
    assert!(
        s.compare_and_swap(&k, 0, b"a".to_vec()).await?,
        "cas: a missing key matches revision 0"
    );
    let v = s
        .get(&k)
        .await?
        .expect("cas: the swapped-in key reads back");
    assert_eq!(v.value, b"a");
    assert!(
        !s.compare_and_swap(&k, v.mod_revision + 7, b"x".to_vec())
            .await?,
        "cas: a stale or future revision is refused"
    );
    assert!(
        !s.compare_and_swap(&k, 0, b"x".to_vec()).await?,
        "cas: an existing key does not match revision 0"
    );
    assert_eq!(
        s.get(&k).await?.map(|v| v.value),
        Some(b"a".to_vec()),
        "cas: a refused swap changes nothing"
    );
    assert!(
        s.compare_and_swap(&k, v.mod_revision, b"b".to_vec())
            .await?,
        "cas: the current revision is accepted"
    );
    assert!(
        !s.compare_and_swap(&k, v.mod_revision, b"c".to_vec())
            .await?,
        "cas: the same revision cannot be used twice"
    );
    assert_eq!(s.get(&k).await?.map(|v| v.value), Some(b"b".to_vec()));
    Ok(())
}

/// `list` returns exactly the keys under the prefix, sorted, with values.
pub async fn list_by_prefix(s: &dyn KvStore, p: &str) -> StoreResult<()> {
    assert!(
        s.list(p).await?.is_empty(),
        "list: an empty prefix lists nothing"
    );
    for k in ["b", "a", "c/d"] {
        s.put(&format!("{p}in/{k}"), k.as_bytes().to_vec()).await?;
    }
    // Neighbours that share a string prefix but not the folder.
    s.put(&format!("{p}in2"), b"no".to_vec()).await?;
    s.put(&format!("{p}i"), b"no".to_vec()).await?;
    let got = s.list(&format!("{p}in/")).await?;
    let want: Vec<(String, Vec<u8>)> = ["a", "b", "c/d"]
        .iter()
        .map(|k| (format!("{p}in/{k}"), k.as_bytes().to_vec()))
        .collect();
    assert_eq!(got, want, "list: the keys under the prefix, sorted");
    assert_eq!(
        s.list(p).await?.len(),
        5,
        "list: everything under the parent"
    );
    Ok(())
}

/// A leased key exists while its guard lives and is gone soon after the
/// guard is dropped; the guard of a healthy store never reports it lost.
pub async fn leased_keys(s: &dyn KvStore, p: &str) -> StoreResult<()> {
    let k = format!("{p}worker");
    let mut guard = s.put_leased(&k, b"alive".to_vec(), 5).await?;
    assert_eq!(
        s.get(&k).await?.map(|v| v.value),
        Some(b"alive".to_vec()),
        "lease: the leased key reads back"
    );
    assert_eq!(s.list(p).await?.len(), 1, "lease: the leased key is listed");
    let lost = tokio::time::timeout(Duration::from_millis(300), guard.lost()).await;
    assert!(
        lost.is_err(),
        "lease: a healthy store does not lose the lease"
    );
    drop(guard);
    // etcd revokes the lease asynchronously; give it a bounded moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while s.get(&k).await?.is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease: the key is still there 5 s after its guard was dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        s.list(p).await?.is_empty(),
        "lease: nothing left under the prefix"
    );
    Ok(())
}

/// A watch first yields the key's current value (`None` when missing), then
/// every change in order, `None` for a deletion; other keys are not seen.
pub async fn watch_sees_every_change(s: &dyn KvStore, p: &str) -> StoreResult<()> {
    let k = format!("{p}k");
    let mut w = s.watch(&k).await?;
    assert_eq!(
        next(&mut w).await?,
        None,
        "watch: a missing key starts as None"
    );
    s.put(&k, b"1".to_vec()).await?;
    s.put(&format!("{p}other"), b"x".to_vec()).await?;
    s.put(&k, b"2".to_vec()).await?;
    s.delete(&k).await?;
    s.put(&k, b"3".to_vec()).await?;
    assert_eq!(next(&mut w).await?, Some(b"1".to_vec()), "watch: first put");
    assert_eq!(
        next(&mut w).await?,
        Some(b"2".to_vec()),
        "watch: second put"
    );
    assert_eq!(next(&mut w).await?, None, "watch: deletion");
    assert_eq!(
        next(&mut w).await?,
        Some(b"3".to_vec()),
        "watch: put after delete"
    );
    let mut w2 = s.watch(&k).await?;
    assert_eq!(
        next(&mut w2).await?,
        Some(b"3".to_vec()),
        "watch: a new watch starts from the current value"
    );
    Ok(())
}

/// The next watch event, within 5 s.
async fn next(
    rx: &mut tokio::sync::mpsc::Receiver<Option<Vec<u8>>>,
) -> StoreResult<Option<Vec<u8>>> {
    let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("watch: no event within 5 s")
        .expect("watch: the stream ended");
    Ok(ev)
}
