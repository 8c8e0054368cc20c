//! The server's accept loop and its end. axum's own loop (`axum::serve`) gives a client as long as
//! it likes to send a request's head, and stops accepting connections as soon as shutdown starts,
//! so that `/readyz` could never say "draining" to anyone. Here each connection is hyper's HTTP/1
//! with a deadline for every request's head ([`HEAD_TIMEOUT`]), and the end has two phases: when
//! `drained` starts (SIGTERM, Ctrl-C) the server goes on accepting and answering (`/readyz` 503,
//! new work 503) until `drained` completes (every accepted job answered); then it stops accepting
//! and each connection finishes the response it is writing, idle ones close.
use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// The most a client may take to send a request's line and headers, on a new connection or a
/// kept-alive one; the connection is closed then.
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` until `drained` completes, then lets the open connections finish.
pub(crate) async fn serve(listener: TcpListener, app: Router, drained: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    tokio::pin!(drained);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                // An accept error (a connection reset before it was taken, a full file table)
                // concerns that connection; the next one is waited for after a pause.
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let service = TowerToHyperService::new(app.clone());
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    let _ = connection.await;
                });
            }
            () = &mut drained => break,
        }
    }
    drop(listener);
    graceful.shutdown().await;
}
