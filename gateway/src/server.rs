//! The HTTP server loop: hyper with explicit limits (header size, idle time) and graceful
//! shutdown (stop accepting, let in-flight requests finish).

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::ingress::limits::Limits;

/// How long in-flight requests get to finish after shutdown starts.
const DRAIN: Duration = Duration::from_secs(30);

pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: &Limits,
    shutdown: impl Future<Output = ()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Runs from the moment a connection waits for a request head, so it is also the
        // idle timeout of kept-alive connections.
        .header_read_timeout(limits.idle_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .keep_alive_interval(Some(limits.idle_timeout))
        .keep_alive_timeout(limits.idle_timeout);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                // The peer's address and the one it connected to, for handlers that need
                // them (the admin API's loopback rule and its `Host` check).
                let local = stream.local_addr().ok();
                let service = TowerToHyperService::new(
                    tower::ServiceBuilder::new()
                        .map_request(move |mut request: http::Request<hyper::body::Incoming>| {
                            request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                            if let Some(local) = local {
                                request.extensions_mut().insert(crate::admin::LocalAddr(local));
                            }
                            request
                        })
                        .service(router.clone()),
                );
                let builder = builder.clone();
                let watcher = graceful.watcher();
                let idle = limits.idle_timeout;
                tokio::spawn(async move {
                    // The version sniffing of the auto builder waits for the first bytes with
                    // no timer of its own: a connection that never speaks is closed here.
                    let mut first = [0u8; 1];
                    if !matches!(tokio::time::timeout(idle, stream.peek(&mut first)).await, Ok(Ok(n)) if n > 0) {
                        return;
                    }
                    let conn = builder
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .into_owned();
                    if let Err(e) = watcher.watch(conn).await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(DRAIN) => {
            tracing::warn!("in-flight requests did not finish within {DRAIN:?}; closing them");
        }
    }
}
