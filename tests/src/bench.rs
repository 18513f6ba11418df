//! What the benchmark binaries share: lines counted as a file grows, a process's CPU
//! time, and a load of batch-mode requests.

use serde_json::Value;

/// Counts the complete lines of a growing file, reading only what was appended since the
/// last look.
#[derive(Default)]
pub struct LineCounter {
    offset: u64,
    pub lines: usize,
}

impl LineCounter {
    pub fn count(&mut self, path: &std::path::Path) -> usize {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(path) else {
            return self.lines;
        };
        let mut buf = Vec::new();
        if f.seek(SeekFrom::Start(self.offset)).is_ok() && f.read_to_end(&mut buf).is_ok() {
            // Up to the last line end: a line being written is counted once it is whole.
            if let Some(end) = buf.iter().rposition(|b| *b == b'\n') {
                self.lines += buf[..=end].iter().filter(|b| **b == b'\n').count();
                self.offset += end as u64 + 1;
            }
        }
        self.lines
    }
}

/// CPU time (user + system) of a process, in seconds.
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may contain spaces) start after ") ".
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    ticks / 100.0
}

/// Posts `events` events (made by `event(n)`) as batches of `batch` from `concurrency`
/// connections, each request answered 202; returns how many were accepted.
pub async fn post_batches(
    url: &str,
    events: usize,
    concurrency: usize,
    batch: usize,
    event: impl Fn(usize) -> Value + Clone + Send + 'static,
) -> usize {
    let client = reqwest::Client::new();
    let mut posters = Vec::new();
    for p in 0..concurrency {
        let (client, url, event) = (client.clone(), url.to_string(), event.clone());
        posters.push(tokio::spawn(async move {
            let mut accepted = 0;
            for b in (p..events / batch).step_by(concurrency) {
                let chunk: Vec<Value> = (0..batch).map(|i| event(b * batch + i)).collect();
                let r = client
                    .post(&url)
                    .header("content-type", "application/cloudevents-batch+json")
                    .body(Value::Array(chunk).to_string())
                    .send()
                    .await
                    .expect("post a batch");
                assert_eq!(r.status().as_u16(), 202);
                accepted += batch;
            }
            accepted
        }));
    }
    let mut accepted = 0;
    for p in posters {
        accepted += p.await.expect("poster");
    }
    accepted
}
