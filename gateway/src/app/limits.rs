//! `[limits]` around every route but the probes, in one layer (`RequestLimits`): at most
//! `max_concurrent_requests` at once (one more is shed with `503` at once rather than
//! queued), and `request_timeout` for receiving a request and answering it (`408`).
//!
//! One service instead of a stack of four (error handler, load shedder, concurrency limit,
//! timeout middleware): each layer of the stack cloned services and boxed futures per
//! request, which cost more than the limits themselves. And `CloseConnections` around
//! everything: which answers close their connection.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;

use crate::ingress::state::IngressState;
use crate::problem::Problem;

/// The layer: `Router::layer` puts one service on each route, and they share the permits.
#[derive(Clone)]
pub(super) struct RequestLimits {
    permits: Arc<Semaphore>,
    timeout: Duration,
}

impl RequestLimits {
    pub(super) fn new(max_concurrent: usize, timeout: Duration) -> RequestLimits {
        RequestLimits {
            permits: Arc::new(Semaphore::new(max_concurrent.max(1))),
            timeout,
        }
    }
}

impl<S> tower::Layer<S> for RequestLimits {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            limits: self.clone(),
        }
    }
}

#[derive(Clone)]
pub(super) struct Limited<S> {
    inner: S,
    limits: RequestLimits,
}

impl<S> tower::Service<Request> for Limited<S>
where
    S: tower::Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let Ok(permit) = self.limits.permits.clone().try_acquire_owned() else {
            return Box::pin(std::future::ready(
                Ok(Problem::overloaded().into_response()),
            ));
        };
        let timeout = self.limits.timeout;
        // Axum's routes are always ready (`poll_ready` above asked all the same).
        let answer = self.inner.call(request);
        Box::pin(async move {
            let _permit = permit;
            match tokio::time::timeout(timeout, answer).await {
                Ok(response) => response,
                Err(_) => Ok(Problem::request_timeout("limits.request_timeout").into_response()),
            }
        })
    }
}

/// While draining, every answer says `Connection: close`: clients open their next request
/// elsewhere instead of reusing a kept-alive connection that is about to close (which
/// would fail a request already on its way). HTTP/2 gets a GOAWAY at the close instead.
/// So does a `413`: the body it refused was not read to its end, so the connection cannot
/// carry another request, and a client that reused it would lose that request.
#[derive(Clone)]
pub(super) struct CloseConnections {
    state: Arc<IngressState>,
}

impl CloseConnections {
    pub(super) fn new(state: Arc<IngressState>) -> CloseConnections {
        CloseConnections { state }
    }
}

impl<S> tower::Layer<S> for CloseConnections {
    type Service = Closing<S>;

    fn layer(&self, inner: S) -> Closing<S> {
        Closing {
            inner,
            state: self.state.clone(),
        }
    }
}

#[derive(Clone)]
pub(super) struct Closing<S> {
    inner: S,
    state: Arc<IngressState>,
}

impl<S> tower::Service<Request> for Closing<S>
where
    S: tower::Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let answer = self.inner.call(request);
        let state = self.state.clone();
        Box::pin(async move {
            let Ok(mut response) = answer.await;
            if state.draining() || response.status() == http::StatusCode::PAYLOAD_TOO_LARGE {
                response.headers_mut().insert(
                    http::header::CONNECTION,
                    http::HeaderValue::from_static("close"),
                );
            }
            Ok(response)
        })
    }
}
