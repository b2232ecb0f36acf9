//! The replay check of routes whose replay store is Redis, made here rather than in the engine so that no
//! exchange waits on Redis with the Python thread: the engine returns a verified message's keys with its verdict
//! (only a message it accepted has any), and the frame sets them all, `SET key 1 NX PX ttl` in one pipelined round
//! trip, before it passes the message on. One key already there is a replay; a Redis that cannot answer within
//! the timeout refuses the message (fail closed). Same keys as the engine's own Redis store (filters/engine/wss/replay.py).
//! The same round trip reads the store's replay epoch (`SET epoch now NX GET`: whoever finds it missing, a Redis
//! restarted empty, starts it): a message whose freshness evidence is not newer than the epoch may have been
//! accepted before the store lost its memory, and is refused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pyo3::prelude::*;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Value};
use tokio::sync::Mutex;
use tokio::time::timeout;

/// As the engine's store: a hung Redis turns into a prompt refusal, not stalled exchanges.
const TIMEOUT: Duration = Duration::from_secs(1);

/// What the engine hands the frame with a verdict on a message whose replay store is Redis: the store's URL, the
/// message's keys (name, TTL in ms), and the key of the store's epoch with the message's freshness evidence (ms).
/// Built once per such message by filters/worker.py; read here off the Python thread, without a copy.
#[pyclass(frozen, get_all, module = "wsgate_frame")]
pub struct ReplayCheck {
    pub url: String,
    pub keys: Vec<(Vec<u8>, u64)>,
    pub epoch_key: Vec<u8>,
    pub since_ms: i64,
}

#[pymethods]
impl ReplayCheck {
    #[new]
    fn new(url: String, keys: Vec<(Vec<u8>, u64)>, epoch_key: Vec<u8>, since_ms: i64) -> Self {
        ReplayCheck { url, keys, epoch_key, since_ms }
    }
}

/// What setting a message's keys found. Every outcome but `First` is handed to `worker.replay_refused`, which
/// matches on it (filters/worker.py).
#[pyclass(frozen, module = "wsgate_frame")]
#[derive(Debug, PartialEq, Eq)]
pub enum ReplayOutcome {
    First(),
    /// `index`: the first of the message's keys that was already set.
    Replayed {
        index: usize,
    },
    /// Every key new, but the message not newer than the store's epoch (both in ms).
    BeforeEpoch {
        epoch_ms: i64,
        since_ms: i64,
    },
    /// Why Redis could not tell (never the URL: it may carry a password).
    Unavailable {
        reason: String,
    },
}

impl ReplayOutcome {
    /// Its index in counters::REPLAY_OUTCOMES.
    pub fn counter(&self) -> usize {
        match self {
            ReplayOutcome::First() => 0,
            ReplayOutcome::Replayed { .. } => 1,
            ReplayOutcome::BeforeEpoch { .. } => 2,
            ReplayOutcome::Unavailable { .. } => 3,
        }
    }
}

/// One multiplexed connection per Redis URL, opened on first use and dropped after any failure. A connection
/// kept from before Redis restarted fails on its next use; that exchange is sent once more on a new connection,
/// so a Redis that came back serves the very next message. Each exchange sets its keys to a value of its own
/// (`SET key value NX PX ttl GET`, Redis 7), so a retry that finds its own first attempt's value (the reply was
/// lost, the key was set) still counts as a first sight, and any other value as a replay.
pub struct Stores {
    connections: Mutex<HashMap<String, (u64, MultiplexedConnection)>>,
    opened: AtomicU64,
    exchanges: AtomicU64,
    instance: String, // this process and its start: no other worker, nor this one restarted, writes the same value
}

impl Default for Stores {
    fn default() -> Self {
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        Stores {
            connections: Mutex::default(),
            opened: AtomicU64::new(0),
            exchanges: AtomicU64::new(0),
            instance: format!("{}.{started}", std::process::id()),
        }
    }
}

/// The message's freshness evidence and the key of the store's epoch (filters/engine/wss/replay.py): the message passes only
/// if `since_ms` is newer than the epoch.
pub struct Epoch<'a> {
    pub key: &'a [u8],
    pub since_ms: i64,
}

impl Stores {
    /// Set every key (name, TTL in ms) in the Redis at `url` and read its epoch; `First` only when each key was
    /// new and the message is newer than the epoch.
    pub async fn first_sight(&self, url: &str, keys: &[(Vec<u8>, u64)], epoch: &Epoch<'_>) -> ReplayOutcome {
        // The same key twice in one message is a replay of itself (Redis would answer the second with our value).
        if let Some(i) = (1..keys.len()).find(|&i| keys[..i].iter().any(|(k, _)| *k == keys[i].0)) {
            return ReplayOutcome::Replayed { index: i };
        }
        let value = format!("{}.{}", self.instance, self.exchanges.fetch_add(1, Ordering::Relaxed));
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let mut pipe = redis::pipe();
        // First: a Redis found empty gets its epoch before any key of this message is in it.
        pipe.cmd("SET").arg(epoch.key).arg(now_ms).arg("NX").arg("GET");
        for (name, px) in keys {
            pipe.cmd("SET").arg(name.as_slice()).arg(&value).arg("NX").arg("PX").arg(*px).arg("GET");
        }
        let mut outcome = self.send(url, &pipe, keys.len(), &value, now_ms, epoch.since_ms).await;
        if let Err(Failure::Stale(_)) = outcome {
            outcome = self.send(url, &pipe, keys.len(), &value, now_ms, epoch.since_ms).await;
        }
        outcome.unwrap_or_else(|failure| match failure {
            Failure::Stale(why) | Failure::Other(why) => ReplayOutcome::Unavailable { reason: why },
        })
    }

    async fn send(
        &self,
        url: &str,
        pipe: &redis::Pipeline,
        count: usize,
        value: &str,
        now_ms: i64,
        since_ms: i64,
    ) -> Result<ReplayOutcome, Failure> {
        let (generation, fresh, mut connection) = match timeout(TIMEOUT, self.connection(url)).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(Failure::Other(describe(&e))),
            Err(_) => return Err(Failure::Other("connect timed out".into())),
        };
        let replies = match timeout(TIMEOUT, pipe.query_async::<Vec<Value>>(&mut connection)).await {
            Ok(Ok(replies)) if replies.len() == count + 1 => replies,
            failed => {
                self.forget(url, generation).await;
                return Err(match failed {
                    // Only a connection opened before this exchange, found closed, is worth a second try.
                    Ok(Err(e)) if !fresh && e.is_connection_dropped() => Failure::Stale(describe(&e)),
                    Ok(Err(e)) => Failure::Other(describe(&e)),
                    Ok(Ok(_)) => Failure::Other("wrong number of replies".into()),
                    Err(_) => Failure::Other("timed out".into()),
                });
            }
        };
        // SET NX GET answers nil when it set the key, else the value that was there.
        let seen_before = |r: &Value| match r {
            Value::Nil => false,
            Value::BulkString(v) => v.as_slice() != value.as_bytes(),
            _ => true,
        };
        if let Some(i) = replies[1..].iter().position(seen_before) {
            return Ok(ReplayOutcome::Replayed { index: i });
        }
        // Nil: we started the epoch (or a retry finds our own value); a value that is no number: fail closed.
        let epoch = match &replies[0] {
            Value::BulkString(v) => std::str::from_utf8(v).ok().and_then(|v| v.parse().ok()).unwrap_or(now_ms),
            _ => now_ms,
        };
        Ok(if since_ms <= epoch {
            ReplayOutcome::BeforeEpoch { epoch_ms: epoch, since_ms }
        } else {
            ReplayOutcome::First()
        })
    }

    /// The connection to `url`, its generation, and whether it was opened just now.
    async fn connection(&self, url: &str) -> redis::RedisResult<(u64, bool, MultiplexedConnection)> {
        let mut connections = self.connections.lock().await;
        if let Some((generation, c)) = connections.get(url) {
            return Ok((*generation, false, c.clone()));
        }
        let config = AsyncConnectionConfig::new().set_connection_timeout(TIMEOUT).set_response_timeout(TIMEOUT);
        let connection = redis::Client::open(url)?.get_multiplexed_async_connection_with_config(&config).await?;
        let generation = self.opened.fetch_add(1, Ordering::Relaxed);
        connections.insert(url.to_owned(), (generation, connection.clone()));
        Ok((generation, true, connection))
    }

    /// Drop the connection that failed, unless another exchange already replaced it.
    async fn forget(&self, url: &str, generation: u64) {
        let mut connections = self.connections.lock().await;
        if connections.get(url).is_some_and(|(g, _)| *g == generation) {
            connections.remove(url);
        }
    }
}

enum Failure {
    Stale(String), // a kept connection found closed: the exchange may be sent once more on a new one
    Other(String),
}

fn describe(e: &redis::RedisError) -> String {
    // The class only: an error on opening may quote the URL, which may carry a password.
    if e.is_connection_refusal() {
        "connection refused".into()
    } else if e.is_timeout() {
        "timed out".into()
    } else {
        e.category().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command, Stdio};

    /// A throwaway redis-server on a free loopback port (as tests/support/harness.py starts one), killed when dropped.
    struct Redis(Child, u16);

    impl Redis {
        fn start(port: u16) -> Redis {
            // Owned at once: a server that never answers is killed (Drop) when the panic below unwinds.
            let redis = Redis(
                Command::new("redis-server")
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("redis-server is needed: apt-get install -y redis-server"),
                port,
            );
            for _ in 0..100 {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return redis;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            panic!("redis-server did not start on {port}");
        }

        fn url(&self) -> String {
            format!("redis://127.0.0.1:{}/0", self.1)
        }
    }

    impl Drop for Redis {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A loopback port for a redis-server started here, chosen by the rules and the block locks of
    /// gateway/control/ports.py (which describes them): outside the kernel's ephemeral range, so no outgoing
    /// connection takes it while Redis is down, and in a block this process holds, so no other test process
    /// (cargo's or pytest's) hands it out. Never handed out twice in this process.
    fn free_port() -> u16 {
        const LOWEST: u16 = 10000;
        const BLOCK: u16 = 256;
        static POOL: std::sync::Mutex<(Vec<std::fs::File>, Vec<u16>)> = std::sync::Mutex::new((Vec::new(), Vec::new()));
        let mut pool = POOL.lock().unwrap();
        loop {
            while let Some(port) = pool.1.pop() {
                if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                    return port;
                }
            }
            let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
            let (low, high) = match range.split_whitespace().map(|v| v.parse::<u32>().unwrap()).collect::<Vec<_>>()[..]
            {
                [low, high] => (low, high),
                _ => panic!("ip_local_port_range: {range}"),
            };
            let below = (u32::from(LOWEST)..low.saturating_sub(u32::from(BLOCK)) + 1).step_by(BLOCK.into());
            let above = (u32::from(LOWEST).max(high + 1)..65536 - u32::from(BLOCK) + 1).step_by(BLOCK.into());
            let uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap());
            let dir = std::env::var_os("WSGATE_PORTS_DIR")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| std::env::temp_dir().join(format!("wsgate-ports-{uid}")));
            std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
                .create(&dir)
                .unwrap();
            let held = pool.0.len();
            for first in below.chain(above) {
                // A block this process holds already fails too: flock conflicts between open files, not processes.
                // (File::try_lock, flock on Unix: Rust 1.89.)
                let file =
                    std::fs::File::options().append(true).create(true).open(dir.join(format!("block-{first}.lock")));
                let file = file.unwrap();
                if file.try_lock().is_ok() {
                    pool.0.push(file);
                    pool.1 = (first as u16..first as u16 + BLOCK).rev().collect();
                    break;
                }
            }
            assert!(pool.0.len() > held, "every loopback port block outside the ephemeral range is reserved");
        }
    }

    /// A message fresher than any epoch: these tests are about its keys.
    const NEW: Epoch = Epoch { key: b"wsgate:epoch", since_ms: i64::MAX };

    fn now_ms() -> i64 {
        SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
    }

    fn keys(names: &[&str]) -> Vec<(Vec<u8>, u64)> {
        names.iter().map(|n| (n.as_bytes().to_vec(), 60_000)).collect()
    }

    #[tokio::test]
    async fn a_message_passes_only_if_every_one_of_its_keys_is_new() {
        let redis = Redis::start(free_port());
        let stores = Stores::default();
        let url = redis.url();
        assert_eq!(stores.first_sight(&url, &keys(&["sig:a", "ut:alice:n1"]), &NEW).await, ReplayOutcome::First());
        assert_eq!(stores.first_sight(&url, &keys(&["sig:a"]), &NEW).await, ReplayOutcome::Replayed { index: 0 });
        // A fresh signature cannot carry a replayed nonce, nor the same key twice.
        assert_eq!(
            stores.first_sight(&url, &keys(&["sig:b", "ut:alice:n1"]), &NEW).await,
            ReplayOutcome::Replayed { index: 1 }
        );
        assert_eq!(
            stores.first_sight(&url, &keys(&["sig:c", "sig:c"]), &NEW).await,
            ReplayOutcome::Replayed { index: 1 }
        );
        // Another worker (its own connection) sees the same keys.
        assert_eq!(
            Stores::default().first_sight(&url, &keys(&["sig:a"]), &NEW).await,
            ReplayOutcome::Replayed { index: 0 }
        );
    }

    #[tokio::test]
    async fn keys_expire_after_their_ttl() {
        let redis = Redis::start(free_port());
        let stores = Stores::default();
        let short = vec![(b"sig:short".to_vec(), 50)];
        assert_eq!(stores.first_sight(&redis.url(), &short, &NEW).await, ReplayOutcome::First());
        assert_eq!(stores.first_sight(&redis.url(), &short, &NEW).await, ReplayOutcome::Replayed { index: 0 });
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(stores.first_sight(&redis.url(), &short, &NEW).await, ReplayOutcome::First());
    }

    #[tokio::test]
    async fn a_redis_that_cannot_answer_fails_closed_and_a_redis_back_is_used_again() {
        let port = free_port();
        let url = format!("redis://127.0.0.1:{port}/0");
        let stores = Stores::default();
        assert!(matches!(stores.first_sight(&url, &keys(&["sig:a"]), &NEW).await, ReplayOutcome::Unavailable { .. }));
        let redis = Redis::start(port);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:a"]), &NEW).await, ReplayOutcome::First());
        drop(redis); // dies with the connection open
        assert!(matches!(stores.first_sight(&url, &keys(&["sig:b"]), &NEW).await, ReplayOutcome::Unavailable { .. }));
        let _redis = Redis::start(port);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:b"]), &NEW).await, ReplayOutcome::First());
    }

    #[tokio::test]
    async fn a_redis_restarted_under_a_kept_connection_serves_the_next_message() {
        let port = free_port();
        let url = format!("redis://127.0.0.1:{port}/0");
        let stores = Stores::default();
        let redis = Redis::start(port);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:a"]), &NEW).await, ReplayOutcome::First());
        drop(redis); // restarted while this worker's connection was open and idle
        let _redis = Redis::start(port);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:b"]), &NEW).await, ReplayOutcome::First());
        assert_eq!(stores.first_sight(&url, &keys(&["sig:b"]), &NEW).await, ReplayOutcome::Replayed { index: 0 });
    }

    #[tokio::test]
    async fn a_retry_that_finds_its_own_value_is_a_first_sight_and_any_other_value_a_replay() {
        let redis = Redis::start(free_port());
        let stores = Stores::default();
        let mut pipe = redis::pipe();
        pipe.cmd("SET").arg(NEW.key).arg(1).arg("NX").arg("GET");
        pipe.cmd("SET").arg("sig:lost").arg("mine").arg("NX").arg("PX").arg(60_000).arg("GET");
        // As if the first attempt had set the key and its reply was lost.
        let url = redis.url();
        let send = |value| stores.send(&url, &pipe, 1, value, 1, i64::MAX);
        assert_eq!(send("mine").await.ok(), Some(ReplayOutcome::First()));
        assert_eq!(send("mine").await.ok(), Some(ReplayOutcome::First()));
        assert_eq!(send("theirs").await.ok(), Some(ReplayOutcome::Replayed { index: 0 }));
        // A key the engine's own store set ("1") is a replay too.
        assert_eq!(
            Stores::default().first_sight(&redis.url(), &keys(&["sig:lost"]), &NEW).await,
            ReplayOutcome::Replayed { index: 0 }
        );
    }

    #[tokio::test]
    async fn a_store_that_lost_its_memory_refuses_what_it_may_have_accepted_before() {
        let port = free_port();
        let url = format!("redis://127.0.0.1:{port}/0");
        let (stores, other_worker) = (Stores::default(), Stores::default());
        let redis = Redis::start(port);
        let before = Epoch { key: NEW.key, since_ms: now_ms() - 1 };
        // The first check of an empty store starts its epoch: a message created earlier proves nothing.
        assert!(matches!(
            stores.first_sight(&url, &keys(&["sig:a"]), &before).await,
            ReplayOutcome::BeforeEpoch { .. }
        ));
        tokio::time::sleep(Duration::from_millis(5)).await;
        let created = Epoch { key: NEW.key, since_ms: now_ms() };
        assert_eq!(stores.first_sight(&url, &keys(&["sig:b"]), &created).await, ReplayOutcome::First());
        assert_eq!(
            other_worker.first_sight(&url, &keys(&["sig:b"]), &created).await,
            ReplayOutcome::Replayed { index: 0 }
        );
        drop(redis); // killed: every key gone
        let _redis = Redis::start(port);
        // The same message again, once the store forgot it: refused, by every worker; a new one passes.
        let outcome = other_worker.first_sight(&url, &keys(&["sig:b"]), &created).await;
        let ReplayOutcome::BeforeEpoch { epoch_ms: epoch, since_ms } = outcome else { panic!("{outcome:?}") };
        assert_eq!(since_ms, created.since_ms);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:b"]), &created).await, ReplayOutcome::Replayed { index: 0 });
        let after = Epoch { key: NEW.key, since_ms: epoch + 1 };
        assert_eq!(stores.first_sight(&url, &keys(&["sig:c"]), &after).await, ReplayOutcome::First());
        // A key already there is reported as the replay it is, whatever the epoch.
        assert_eq!(stores.first_sight(&url, &keys(&["sig:c"]), &before).await, ReplayOutcome::Replayed { index: 0 });
    }

    #[tokio::test]
    async fn a_refused_password_is_reported_without_it() {
        let redis = Redis::start(free_port());
        let url = redis.url().replace("redis://", "redis://user:s3cret-pw@");
        match Stores::default().first_sight(&url, &keys(&["sig:a"]), &NEW).await {
            ReplayOutcome::Unavailable { reason: detail } => assert!(!detail.contains("s3cret-pw"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }
}
