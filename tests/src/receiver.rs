//! An HTTP/1.1 receiver on a free loopback port, for target tests. It records every request
//! and answers from a script (then a default answer): a status, 429 with Retry-After, a
//! CloudEvent reply, a sleep, a hang, or a dropped connection. Written on raw TCP so that
//! hanging and closing are real socket behaviour.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the receiver answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// An empty answer with this status.
    Status(u16),
    /// `429 Too Many Requests` with `Retry-After: secs`.
    RetryAfter(u64),
    /// Waits, then answers with the status.
    Sleep(Duration, u16),
    /// Never answers (the connection stays open until the client gives up).
    Hang,
    /// Closes the connection without answering.
    Close,
    /// A full answer: status, headers and body (e.g. a CloudEvent for a function).
    Full(u16, Vec<(String, String)>, Vec<u8>),
}

/// One request as received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    /// Header names lower-cased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub at: Instant,
    /// The status it was answered with (0 for a hang or a closed connection).
    pub status: u16,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Answered with a 2xx.
    pub fn was_accepted(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// The event ids (`ce-id`) of binary-mode requests, in arrival order.
pub fn event_ids(received: &[Received]) -> Vec<String> {
    received
        .iter()
        .filter_map(|r| r.header("ce-id").map(str::to_string))
        .collect()
}

#[derive(Default)]
struct State {
    script: VecDeque<Reply>,
    default: Option<Reply>,
    received: Vec<Received>,
    /// Requests answered with 2xx.
    accepted: usize,
    /// Requests received and not yet answered, and the most there ever were.
    in_flight: usize,
    peak_in_flight: usize,
}

pub struct Receiver {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Starts a receiver answering 200 to everything.
    pub async fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind receiver");
        let addr = listener.local_addr().expect("receiver address");
        let state = Arc::new(Mutex::new(State {
            default: Some(Reply::Status(200)),
            ..State::default()
        }));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, shared.clone()));
            }
        });
        Receiver { addr, state, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Answers the next requests with these, in order, then with the default.
    pub fn script(&self, replies: impl IntoIterator<Item = Reply>) {
        self.state.lock().unwrap().script.extend(replies);
    }

    /// The answer once the script is used up.
    pub fn default_reply(&self, reply: Reply) {
        self.state.lock().unwrap().default = Some(reply);
    }

    /// Fails the next `n` requests with `status`, then succeeds.
    pub fn fail_times(&self, n: usize, status: u16) {
        self.script(std::iter::repeat_n(Reply::Status(status), n));
    }

    pub fn received(&self) -> Vec<Received> {
        self.state.lock().unwrap().received.clone()
    }

    /// The most requests that were ever in flight at once (received, not yet answered).
    pub fn peak_in_flight(&self) -> usize {
        self.state.lock().unwrap().peak_in_flight
    }

    /// Requests answered with a 2xx.
    pub fn accepted(&self) -> usize {
        self.state.lock().unwrap().accepted
    }

    /// Waits until `n` requests were answered with a 2xx, or panics after `limit`. It reads
    /// a count, not a copy of everything received, so a benchmark's wait does not take the
    /// CPU it measures.
    pub async fn wait_accepted(&self, n: usize, limit: Duration) {
        crate::wait_until(
            limit,
            Duration::from_millis(20),
            || self.accepted(),
            |&accepted| accepted >= n,
            |accepted| format!("{accepted} of {n} requests accepted"),
        )
        .await;
    }

    /// Waits until `pred` holds for what was received, or panics after `limit`; returns the
    /// list the predicate held for (each request carries the status it was answered with,
    /// so a predicate on accepted requests reads the same list the caller gets).
    pub async fn wait_for(
        &self,
        limit: Duration,
        pred: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let read = || self.received();
        crate::wait_list(
            limit,
            Duration::from_millis(20),
            read,
            pred,
            "requests received",
        )
        .await
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>) {
    let mut buf = Vec::with_capacity(8192);
    loop {
        // Read one request head.
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i;
            }
            let mut chunk = [0u8; 8192];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let request_line = lines.next().unwrap_or_default().to_string();
        let mut parts = request_line.split(' ');
        let method = parts.next().unwrap_or_default().to_string();
        let path = parts.next().unwrap_or_default().to_string();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let body_start = head_end + 4;
        while buf.len() < body_start + length {
            let mut chunk = [0u8; 8192];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = buf[body_start..body_start + length].to_vec();
        buf.drain(..body_start + length);
        let reply = {
            let mut state = state.lock().unwrap();
            let reply = state
                .script
                .pop_front()
                .or_else(|| state.default.clone())
                .unwrap_or(Reply::Status(200));
            let status = match &reply {
                Reply::Status(s) | Reply::Sleep(_, s) | Reply::Full(s, _, _) => *s,
                Reply::RetryAfter(_) => 429,
                Reply::Hang | Reply::Close => 0,
            };
            if (200..300).contains(&status) {
                state.accepted += 1;
            }
            state.received.push(Received {
                method,
                path,
                headers,
                body,
                at: Instant::now(),
                status,
            });
            state.in_flight += 1;
            state.peak_in_flight = state.peak_in_flight.max(state.in_flight);
            reply
        };
        let answered = {
            let state = state.clone();
            move || state.lock().unwrap().in_flight -= 1
        };
        let (status, headers, body) = match reply {
            Reply::Status(s) => (s, vec![], vec![]),
            Reply::RetryAfter(secs) => (
                429,
                vec![("retry-after".to_string(), secs.to_string())],
                vec![],
            ),
            Reply::Sleep(d, s) => {
                tokio::time::sleep(d).await;
                (s, vec![], vec![])
            }
            Reply::Hang => {
                // Hold the connection until the client gives up (bounded for tidiness).
                tokio::time::sleep(Duration::from_secs(600)).await;
                answered();
                return;
            }
            Reply::Close => {
                answered();
                return;
            }
            Reply::Full(s, h, b) => (s, h, b),
        };
        let mut out = format!("HTTP/1.1 {status} X\r\ncontent-length: {}\r\n", body.len());
        for (k, v) in headers {
            out.push_str(&format!("{k}: {v}\r\n"));
        }
        out.push_str("\r\n");
        let mut bytes = out.into_bytes();
        bytes.extend_from_slice(&body);
        let written = stream.write_all(&bytes).await;
        answered();
        if written.is_err() {
            return;
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A receiver on hyper's server answering 200 to everything, for protocol tests of the
/// HTTP target: h2c (HTTP/2 without TLS, for `http2_prior_knowledge`) or TLS with ALPN (h2
/// and HTTP/1.1). It counts requests by protocol and the connections they arrived on.
pub struct HyperReceiver {
    addr: SocketAddr,
    tls: bool,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Counts {
    requests: std::sync::atomic::AtomicUsize,
    h2_requests: std::sync::atomic::AtomicUsize,
    connections: std::sync::atomic::AtomicUsize,
}

impl HyperReceiver {
    /// HTTP/2 with prior knowledge, no TLS.
    pub async fn h2c() -> HyperReceiver {
        HyperReceiver::start(None).await
    }

    /// TLS with the test certificate of `tests/fixtures/tls` (signed by its `ca.pem`).
    pub async fn tls() -> HyperReceiver {
        use tokio_rustls::rustls;
        use tokio_rustls::rustls::pki_types::pem::PemObject as _;
        use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let dir = crate::repo_root().join("tests/fixtures/tls");
        let certs = CertificateDer::pem_file_iter(dir.join("server.pem"))
            .expect("server.pem")
            .collect::<Result<Vec<_>, _>>()
            .expect("server.pem certificates");
        let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).expect("server.key");
        let mut config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("TLS server config");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        HyperReceiver::start(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config)))).await
    }

    async fn start(tls: Option<tokio_rustls::TlsAcceptor>) -> HyperReceiver {
        use std::sync::atomic::Ordering;

        use http_body_util::{BodyExt as _, Empty};
        use hyper::body::Bytes;
        use hyper_util::rt::{TokioExecutor, TokioIo};

        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind receiver");
        let addr = listener.local_addr().expect("receiver address");
        let counts = Arc::new(Counts::default());
        let shared = counts.clone();
        let is_tls = tls.is_some();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                shared.connections.fetch_add(1, Ordering::SeqCst);
                let counts = shared.clone();
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let counts = counts.clone();
                        async move {
                            let is_h2 = req.version() == hyper::Version::HTTP_2;
                            let _ = req.into_body().collect().await;
                            if is_h2 {
                                counts.h2_requests.fetch_add(1, Ordering::SeqCst);
                            }
                            counts.requests.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(
                                Empty::<Bytes>::new(),
                            ))
                        }
                    },
                );
                let tls = tls.clone();
                tokio::spawn(async move {
                    match tls {
                        None => {
                            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                        Some(acceptor) => {
                            let Ok(stream) = acceptor.accept(stream).await else {
                                return;
                            };
                            let _ =
                                hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                                    .serve_connection(TokioIo::new(stream), service)
                                    .await;
                        }
                    }
                });
            }
        });
        HyperReceiver {
            addr,
            tls: is_tls,
            counts,
            task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}{path}", self.addr)
    }

    /// (requests, of which HTTP/2, TCP connections).
    pub fn counts(&self) -> (usize, usize, usize) {
        use std::sync::atomic::Ordering;
        (
            self.counts.requests.load(Ordering::SeqCst),
            self.counts.h2_requests.load(Ordering::SeqCst),
            self.counts.connections.load(Ordering::SeqCst),
        )
    }

    /// Waits until `n` requests arrived, or panics after `limit`.
    pub async fn wait_requests(&self, n: usize, limit: Duration) -> (usize, usize, usize) {
        crate::wait_until(
            limit,
            Duration::from_millis(20),
            || self.counts(),
            |counts| counts.0 >= n,
            |counts| format!("received {counts:?} of {n} requests"),
        )
        .await
    }
}

impl Drop for HyperReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
