use super::Sqlite;
use crate::kv::KvStore;
use crate::types::ErrorKind;

#[tokio::test]
async fn a_file_keeps_versions_counters_and_refusals_across_opens() {
    let dir = std::env::temp_dir().join(format!("shallot-kv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kv.db");
    let _ = std::fs::remove_file(&path);
    let store = Sqlite::open(&path).await.unwrap();
    let version = store.set("n", None, "k", "one", None).await.unwrap();
    assert_eq!(store.add("n", None, "c", 5, None).await.unwrap().value, 5);
    assert_eq!(
        store.add("n", None, "k", 1, None).await.unwrap_err().kind,
        ErrorKind::InvalidRequest
    );
    let again = Sqlite::open(&path).await.unwrap();
    assert_eq!(again.get("n", "k").await.unwrap().unwrap().version, version);
    assert_eq!(again.add("n", None, "c", -2, None).await.unwrap().value, 3);
    assert!(
        again
            .swap("n", None, "k", "two", version, None)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        store
            .swap("n", None, "k", "three", version, None)
            .await
            .unwrap(),
        None
    );
    assert!(
        again.get("m", "k").await.unwrap().is_none(),
        "namespaces are apart"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A file written before owners were kept opens with its keys no
/// one's, and owned writes go on in it.
#[tokio::test]
async fn a_file_from_before_owners_opens_with_its_keys_no_ones() {
    let dir = std::env::temp_dir().join(format!("shallot-kv-old-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kv.db");
    let _ = std::fs::remove_file(&path);
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch(
            "CREATE TABLE shallot_kv (
                 namespace TEXT NOT NULL,
                 key TEXT NOT NULL,
                 value TEXT NOT NULL,
                 version INTEGER NOT NULL,
                 expires INTEGER,
                 PRIMARY KEY (namespace, key)
             ) WITHOUT ROWID;
             INSERT INTO shallot_kv VALUES ('n', 'old', 'kept', 7, NULL);",
        )
        .unwrap();
    let store = Sqlite::open(&path).await.unwrap();
    assert_eq!(store.get("n", "old").await.unwrap().unwrap().value, "kept");
    let wide = "v".repeat(1 << 20);
    let mut n = 0;
    while store
        .set("n", Some("t"), &format!("k{n}"), &wide, None)
        .await
        .is_ok()
    {
        n += 1;
    }
    assert_eq!(n, 7, "an owner's part of a stored namespace is 8 MiB");
    store.set("n", None, "old", &wide, None).await.unwrap();
    Sqlite::open(&path).await.expect("opened again");
    let _ = std::fs::remove_dir_all(&dir);
}
