//! The replay check of routes whose replay store is Redis, made here rather than in the engine so that no
//! exchange waits on Redis with the Python thread: the engine returns a verified message's keys with its verdict
//! (only a message it accepted has any), and the frame sets them all, `SET key 1 NX PX ttl` in one pipelined round
//! trip, before it passes the message on. One key already there is a replay; a Redis that cannot answer within
//! the timeout refuses the message (fail closed). Same keys as the engine's own Redis store (filters/replay.py).

use std::collections::HashMap;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Value};
use tokio::sync::Mutex;
use tokio::time::timeout;

/// As the engine's store: a hung Redis turns into a prompt refusal, not stalled exchanges.
const TIMEOUT: Duration = Duration::from_secs(1);

/// What setting a message's keys found.
#[derive(Debug, PartialEq, Eq)]
pub enum Sight {
    First,
    Replayed(usize),     // the index of the first key that was already set
    Unavailable(String), // why Redis could not tell (never the URL: it may carry a password)
}

impl Sight {
    /// Its index in counters::SIGHTS.
    pub fn counter(&self) -> usize {
        match self {
            Sight::First => 0,
            Sight::Replayed(_) => 1,
            Sight::Unavailable(_) => 2,
        }
    }
}

/// One multiplexed connection per Redis URL, opened on first use and dropped after any failure, so that a
/// Redis that came back is reached again by the next exchange. Commands are never retried: a SET NX retried
/// after a lost reply would report its own first attempt as a replay.
#[derive(Default)]
pub struct Stores {
    connections: Mutex<HashMap<String, (u64, MultiplexedConnection)>>,
    opened: std::sync::atomic::AtomicU64,
}

impl Stores {
    /// Set every key (name, TTL in ms) in the Redis at `url`; `First` only when each one was new.
    pub async fn first_sight(&self, url: &str, keys: &[(Vec<u8>, u64)]) -> Sight {
        let (generation, mut connection) = match timeout(TIMEOUT, self.connection(url)).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Sight::Unavailable(describe(&e)),
            Err(_) => return Sight::Unavailable("connect timed out".into()),
        };
        let mut pipe = redis::pipe();
        for (name, px) in keys {
            pipe.cmd("SET").arg(name.as_slice()).arg("1").arg("NX").arg("PX").arg(*px);
        }
        let replies = match timeout(TIMEOUT, pipe.query_async::<Vec<Value>>(&mut connection)).await {
            Ok(Ok(replies)) if replies.len() == keys.len() => replies,
            failed => {
                self.forget(url, generation).await;
                return Sight::Unavailable(match failed {
                    Ok(Err(e)) => describe(&e),
                    Ok(Ok(_)) => "wrong number of replies".into(),
                    Err(_) => "timed out".into(),
                });
            }
        };
        // SET NX answers OK when it set the key, nil when the key was there.
        match replies.iter().position(|r| matches!(r, Value::Nil)) {
            Some(i) => Sight::Replayed(i),
            None => Sight::First,
        }
    }

    async fn connection(&self, url: &str) -> redis::RedisResult<(u64, MultiplexedConnection)> {
        let mut connections = self.connections.lock().await;
        if let Some((generation, c)) = connections.get(url) {
            return Ok((*generation, c.clone()));
        }
        let config = AsyncConnectionConfig::new().set_connection_timeout(TIMEOUT).set_response_timeout(TIMEOUT);
        let connection = redis::Client::open(url)?.get_multiplexed_async_connection_with_config(&config).await?;
        let generation = self.opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        connections.insert(url.to_owned(), (generation, connection.clone()));
        Ok((generation, connection))
    }

    /// Drop the connection that failed, unless another exchange already replaced it.
    async fn forget(&self, url: &str, generation: u64) {
        let mut connections = self.connections.lock().await;
        if connections.get(url).is_some_and(|(g, _)| *g == generation) {
            connections.remove(url);
        }
    }
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

    /// A throwaway redis-server on a free loopback port (as tests/harness.py starts one), killed when dropped.
    struct Redis(Child, u16);

    impl Redis {
        fn start(port: u16) -> Redis {
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .spawn()
                .expect("redis-server is needed: apt-get install -y redis-server");
            for _ in 0..100 {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Redis(child, port);
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

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn keys(names: &[&str]) -> Vec<(Vec<u8>, u64)> {
        names.iter().map(|n| (n.as_bytes().to_vec(), 60_000)).collect()
    }

    #[tokio::test]
    async fn a_message_passes_only_if_every_one_of_its_keys_is_new() {
        let redis = Redis::start(free_port());
        let stores = Stores::default();
        let url = redis.url();
        assert_eq!(stores.first_sight(&url, &keys(&["sig:a", "ut:alice:n1"])).await, Sight::First);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:a"])).await, Sight::Replayed(0));
        // A fresh signature cannot carry a replayed nonce, nor the same key twice.
        assert_eq!(stores.first_sight(&url, &keys(&["sig:b", "ut:alice:n1"])).await, Sight::Replayed(1));
        assert_eq!(stores.first_sight(&url, &keys(&["sig:c", "sig:c"])).await, Sight::Replayed(1));
        // Another worker (its own connection) sees the same keys.
        assert_eq!(Stores::default().first_sight(&url, &keys(&["sig:a"])).await, Sight::Replayed(0));
    }

    #[tokio::test]
    async fn keys_expire_after_their_ttl() {
        let redis = Redis::start(free_port());
        let stores = Stores::default();
        let short = vec![(b"sig:short".to_vec(), 50)];
        assert_eq!(stores.first_sight(&redis.url(), &short).await, Sight::First);
        assert_eq!(stores.first_sight(&redis.url(), &short).await, Sight::Replayed(0));
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(stores.first_sight(&redis.url(), &short).await, Sight::First);
    }

    #[tokio::test]
    async fn a_redis_that_cannot_answer_fails_closed_and_a_redis_back_is_used_again() {
        let port = free_port();
        let url = format!("redis://127.0.0.1:{port}/0");
        let stores = Stores::default();
        assert!(matches!(stores.first_sight(&url, &keys(&["sig:a"])).await, Sight::Unavailable(_)));
        let redis = Redis::start(port);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:a"])).await, Sight::First);
        drop(redis); // dies with the connection open
        assert!(matches!(stores.first_sight(&url, &keys(&["sig:b"])).await, Sight::Unavailable(_)));
        let _redis = Redis::start(port);
        assert_eq!(stores.first_sight(&url, &keys(&["sig:b"])).await, Sight::First);
    }

    #[tokio::test]
    async fn a_refused_password_is_reported_without_it() {
        let redis = Redis::start(free_port());
        let url = redis.url().replace("redis://", "redis://user:s3cret-pw@");
        match Stores::default().first_sight(&url, &keys(&["sig:a"])).await {
            Sight::Unavailable(detail) => assert!(!detail.contains("s3cret-pw"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }
}
