//! The call channel between a real listener and real connections on loopback, with a
//! hand-driven actor queue standing in for a host.

use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::client::{connect, Connection, Unsent};
use super::frame::{RequestHeader, RequestKind};
use super::socket::{CallAddress, LocalAddress, Transport};
use super::{CallCounters, Routes};
use super::{CallPath, CallServer, CallTls};
use crate::net::wire::{self, CallError, Wire};
use regatta_proto::{ActorId, Failure};

const ACTOR: ActorId = ActorId(7);

fn tls_for(token: &str) -> CallTls {
    CallTls::new(&regatta_net::identity_from_secret(token).unwrap())
}

struct Served {
    server: CallServer,
    tls: CallTls,
    // Kept so the route stays open.
    _queue: UnboundedSender<Wire>,
}

/// A listener on loopback whose actor 7's queue is `inbox`.
async fn serve(token: &str) -> (Served, UnboundedReceiver<Wire>) {
    serve_with(tls_for(token)).await
}

/// [`serve`] with the listener's TLS `tls`.
async fn serve_with(tls: CallTls) -> (Served, UnboundedReceiver<Wire>) {
    let routes = Routes::default();
    let (queue, inbox) = unbounded_channel();
    routes.insert(
        ACTOR,
        0,
        &queue,
        prometheus::IntGauge::new("depth", "test").expect("a gauge"),
    );
    let server = CallServer::start(
        [127, 0, 0, 1].into(),
        0,
        "127.0.0.1",
        &tls,
        "n1".into(),
        routes,
        CallCounters::unregistered(),
    )
    .await
    .unwrap();
    (
        Served {
            server,
            tls,
            _queue: queue,
        },
        inbox,
    )
}

/// A connection by the listener's advertised address (its Unix socket: same host).
async fn open(served: &Served) -> Connection {
    connect(&served.tls, served.server.address(), "n1").await.unwrap()
}

/// A connection by TCP only.
async fn open_tcp(served: &Served) -> Connection {
    let tcp_only = CallAddress {
        local: None,
        ..served.server.address().clone()
    };
    let connection = connect(&served.tls, &tcp_only, "n1").await.unwrap();
    assert_eq!(connection.transport(), Transport::Tcp);
    connection
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Answers every call with its request reversed, recording casts, until the queue closes.
fn reverse_calls(mut inbox: UnboundedReceiver<Wire>) -> tokio::task::JoinHandle<Vec<Vec<u8>>> {
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Some(message) = inbox.recv().await {
            match message {
                Wire::Call(mut request, port) => {
                    seen.push(request.clone());
                    request.reverse();
                    let _ = port.send(wire::encode_ok(&request));
                }
                Wire::Cast(message, _) => seen.push(message),
                _ => {}
            }
        }
        seen
    })
}

fn answer(reply: Vec<u8>) -> Result<Vec<u8>, Failure> {
    wire::decode(&reply, "reply").unwrap()
}

/// 200 concurrent calls and one at the message limit over `connection`.
async fn each_call_gets_its_own_reply(connection: &Connection) {
    let calls = (0..200u32).map(|i| async move {
        let request = i.to_le_bytes().to_vec();
        let reply = connection.call(ACTOR, &request, soon()).await.ok().unwrap();
        let mut expected = request;
        expected.reverse();
        assert_eq!(answer(reply), Ok(expected));
    });
    futures::future::join_all(calls).await;
    let big: Vec<u8> = (0..wire::MAX_MESSAGE_BYTES).map(|i| (i % 251) as u8).collect();
    let reply = connection.call(ACTOR, &big, soon()).await.ok().unwrap();
    let mut expected = big;
    expected.reverse();
    assert_eq!(answer(reply), Ok(expected));
}

#[tokio::test]
async fn concurrent_calls_each_get_their_own_reply_by_either_socket() {
    let (served, inbox) = serve("t").await;
    reverse_calls(inbox);
    let local = open(&served).await;
    assert_eq!(local.transport(), Transport::Unix, "same host: the Unix socket");
    each_call_gets_its_own_reply(&local).await;
    each_call_gets_its_own_reply(&open_tcp(&served).await).await;
}

#[tokio::test]
async fn a_timed_call_brings_back_stamps_in_hop_order_with_the_actors_time_where_it_was_spent() {
    // Long beside the other hops (tens of microseconds) even on a loaded machine.
    const HANDLER: Duration = Duration::from_millis(300);
    let (served, mut inbox) = serve("t").await;
    // An actor whose handler takes 300 ms: that time must show in the actor's hop alone.
    tokio::spawn(async move {
        while let Some(message) = inbox.recv().await {
            if let Wire::Call(request, port) = message {
                tokio::time::sleep(HANDLER).await;
                let _ = port.send(wire::encode_ok(&request));
            }
        }
    });
    for connection in [open(&served).await, open_tcp(&served).await] {
        let (reply, hops) = connection.call_with(ACTOR, b"timed", soon(), true).await.ok().unwrap();
        assert_eq!(
            answer(reply),
            Ok(b"timed".to_vec()),
            "the stamps are not part of the answer"
        );
        let hops = hops.expect("a timed call over the channel has stamps");
        let server = hops.server;
        let order = [
            hops.start,
            hops.sent,
            server.read,
            server.queued,
            server.answered,
            server.writing,
            hops.received,
            hops.woken,
        ];
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "stamps out of order: {order:?}");
        let actor = Duration::from_nanos(server.answered - server.queued);
        let rest = Duration::from_nanos(hops.woken - hops.start) - actor;
        assert!(actor >= HANDLER, "the handler's time shows in the actor hop: {actor:?}");
        assert!(rest < HANDLER, "and not elsewhere: {rest:?} outside the actor hop");
        let (_, untimed) = connection.call_with(ACTOR, b"plain", soon(), false).await.ok().unwrap();
        assert!(untimed.is_none(), "an ordinary call carries no stamps");
    }
}

#[tokio::test]
async fn a_unix_socket_of_another_host_or_gone_is_passed_over_for_tcp() {
    let (served, inbox) = serve("t").await;
    reverse_calls(inbox);
    let address = served.server.address().clone();
    let local = address.local.clone().expect("a Unix socket on Linux");
    let elsewhere = CallAddress {
        local: Some(LocalAddress {
            host: format!("another-{}", local.host),
            ..local.clone()
        }),
        ..address.clone()
    };
    let gone = CallAddress {
        local: Some(LocalAddress {
            name: format!("{}-gone", local.name),
            ..local
        }),
        ..address
    };
    for address in [elsewhere, gone] {
        let connection = connect(&served.tls, &address, "n1").await.unwrap();
        assert_eq!(connection.transport(), Transport::Tcp);
        assert!(connection.call(ACTOR, b"ab", soon()).await.is_ok());
    }
}

#[tokio::test]
async fn casts_and_calls_reach_the_actor_in_the_order_sent() {
    let (served, inbox) = serve("t").await;
    let seen = reverse_calls(inbox);
    let connection = open(&served).await;
    for i in 0..50u8 {
        connection.cast(ACTOR, &[i]).await.ok().unwrap();
    }
    connection.call(ACTOR, &[50], soon()).await.ok().unwrap();
    drop(connection);
    drop(served);
    let seen = tokio::time::timeout(Duration::from_secs(10), seen)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(seen, (0..=50u8).map(|i| vec![i]).collect::<Vec<_>>());
}

#[tokio::test]
async fn an_actor_not_hosted_here_is_answered_not_hosted() {
    let (served, _inbox) = serve("t").await;
    let connection = open(&served).await;
    let reply = connection.call(ActorId(8), b"x", soon()).await.ok().unwrap();
    assert_eq!(
        answer(reply),
        Err(Failure::NotHosted {
            actor: ActorId(8),
            node: "n1".into()
        })
    );
}

#[tokio::test]
async fn a_call_the_actor_drops_is_lost_and_the_connection_goes_on() {
    let (served, mut inbox) = serve("t").await;
    let connection = open(&served).await;
    let host = tokio::spawn(async move {
        // Drops the first call's reply port; answers the second.
        if let Some(Wire::Call(_, port)) = inbox.recv().await {
            drop(port);
        }
        if let Some(Wire::Call(_, port)) = inbox.recv().await {
            let _ = port.send(wire::encode_ok(&1u8));
        }
    });
    match connection.call(ACTOR, b"a", soon()).await {
        Err(Unsent::Failed(CallError::Unreachable(why))) => assert!(why.contains("before replying"), "{why}"),
        _ => panic!("a dropped call must be reported lost"),
    }
    assert!(connection.call(ACTOR, b"b", soon()).await.is_ok());
    host.await.unwrap();
}

#[tokio::test]
async fn a_call_without_an_answer_times_out_and_leaves_the_connection_usable() {
    let (served, mut inbox) = serve("t").await;
    let connection = open(&served).await;
    let started = Instant::now();
    let outcome = connection
        .call(ACTOR, b"slow", Instant::now() + Duration::from_millis(200))
        .await;
    assert!(matches!(outcome, Err(Unsent::Failed(CallError::Timeout))));
    assert!(started.elapsed() < Duration::from_secs(5));
    // The late answer is dropped; the next call gets its own.
    let Some(Wire::Call(_, late)) = inbox.recv().await else {
        panic!("the call reached the actor")
    };
    let _ = late.send(wire::encode_ok(&0u8));
    reverse_calls(inbox);
    let reply = connection.call(ACTOR, b"ab", soon()).await.ok().unwrap();
    assert_eq!(answer(reply), Ok(b"ba".to_vec()));
    assert!(connection.is_open());
}

#[tokio::test]
async fn a_peer_with_another_token_is_refused_and_the_listener_serves_on() {
    let (served, inbox) = serve("right").await;
    reverse_calls(inbox);
    let stranger = tls_for("wrong");
    let tcp_only = CallAddress {
        local: None,
        ..served.server.address().clone()
    };
    for address in [served.server.address(), &tcp_only] {
        let refused = match connect(&stranger, address, "n1").await {
            // TLS 1.3 may finish the client's side before the server checks its
            // certificate: then the first call finds the connection closed.
            Ok(connection) => connection.call(ACTOR, b"x", soon()).await.is_err(),
            Err(_) => true,
        };
        assert!(refused, "a peer without the token must not reach the actor");
    }
    let connection = open(&served).await;
    assert!(connection.call(ACTOR, b"ok", soon()).await.is_ok());
}

#[tokio::test]
async fn a_call_meant_for_one_node_is_not_answered_by_another_nodes_certificate() {
    use regatta_net::{ClusterCa, Role, TlsIdentity};
    let ca = ClusterCa::generate().unwrap();
    let node = |name: &str| CallTls::new(&TlsIdentity::issued_by(&ca, &Role::Node(name.into())).unwrap());
    // The listener holds n2's certificate of the same cluster.
    let (served, inbox) = serve_with(node("n2")).await;
    reverse_calls(inbox);
    let caller = node("n9");
    let tcp_only = CallAddress {
        local: None,
        ..served.server.address().clone()
    };
    for address in [served.server.address(), &tcp_only] {
        let err = connect(&caller, address, "n1")
            .await
            .err()
            .expect("n2 cannot answer for n1");
        assert!(err.to_string().contains("TLS handshake"), "{err}");
        let connection = connect(&caller, address, "n2").await.expect("n2 answers for itself");
        assert!(connection.call(ACTOR, b"ok", soon()).await.is_ok());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_faster_than_its_actor_is_held_back_at_a_bound() {
    use super::server::PENDING_CALLS;
    let (served, mut inbox) = serve("t").await;
    let connection = std::sync::Arc::new(open(&served).await);
    // Far more calls than the bound, to an actor that answers none of them.
    let total = 2 * PENDING_CALLS + 8_000;
    let caller = connection.clone();
    let calls = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(120);
        futures::future::join_all((0..total).map(|_| caller.call(ACTOR, b"x", deadline))).await
    });
    let mut delivered = Vec::new();
    let bound = 2 * PENDING_CALLS + 1;
    let started = Instant::now();
    while delivered.len() < 2 * PENDING_CALLS && started.elapsed() < Duration::from_secs(30) {
        match inbox.try_recv() {
            Ok(message) => delivered.push(message),
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    // Time for more to arrive, were the node still reading.
    tokio::time::sleep(Duration::from_secs(1)).await;
    while let Ok(message) = inbox.try_recv() {
        delivered.push(message);
    }
    assert!(
        (2 * PENDING_CALLS..=bound).contains(&delivered.len()),
        "{} of {total} calls reached the actor; the bound is {bound}",
        delivered.len()
    );
    calls.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caster_faster_than_its_actor_is_held_back_at_a_bound() {
    use super::server::PENDING_CALLS;
    let (served, mut inbox) = serve("t").await;
    let connection = std::sync::Arc::new(open(&served).await);
    // More casts than the bound, to an actor that takes none off its queue (the messages
    // are kept, holds and all, as a busy actor's queue keeps them).
    let total = PENDING_CALLS + 4_000;
    let caster = connection.clone();
    let casts = tokio::spawn(async move {
        for _ in 0..total {
            if caster.cast(ACTOR, b"x").await.is_err() {
                return;
            }
        }
    });
    let mut queued = Vec::new();
    let started = Instant::now();
    while queued.len() < PENDING_CALLS && started.elapsed() < Duration::from_secs(30) {
        match inbox.try_recv() {
            Ok(message) => queued.push(message),
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    // Time for more to arrive, were the node still reading.
    tokio::time::sleep(Duration::from_secs(1)).await;
    while let Ok(message) = inbox.try_recv() {
        queued.push(message);
    }
    assert_eq!(
        queued.len(),
        PENDING_CALLS,
        "{} of {total} casts queued; the bound is {PENDING_CALLS}",
        queued.len()
    );
    // Taken off the queue, they make room: the rest arrive, none lost.
    let mut delivered = queued.len();
    drop(queued);
    let started = Instant::now();
    while delivered < total && started.elapsed() < Duration::from_secs(30) {
        match inbox.try_recv() {
            Ok(message) => {
                delivered += 1;
                drop(message);
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    assert_eq!(delivered, total);
    casts.await.unwrap();
}

#[tokio::test]
async fn garbage_on_the_port_closes_that_connection_only() {
    let (served, inbox) = serve("t").await;
    reverse_calls(inbox);
    // Plain bytes where a TLS handshake belongs.
    let tcp = &served.server.address().tcp;
    let mut plain = tokio::net::TcpStream::connect(tcp).await.unwrap();
    plain.write_all(&[0xff; 4096]).await.unwrap();
    // A frame of an unknown kind inside TLS.
    let stream = tokio::net::TcpStream::connect(tcp).await.unwrap();
    let mut tls = served
        .tls
        .connector
        .connect(served.tls.server_name("n1"), stream)
        .await
        .unwrap();
    let mut bad = RequestHeader::frame(RequestKind::Call, 1, ACTOR, b"x");
    bad[0] = 9;
    tls.write_all(&bad).await.unwrap();
    tls.flush().await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read(&mut tls, &mut byte),
    )
    .await
    .expect("the listener closes a connection that sent a bad frame");
    assert!(matches!(read, Ok(0) | Err(_)), "no answer to a bad frame");
    let connection = open(&served).await;
    assert!(connection.call(ACTOR, b"ok", soon()).await.is_ok());
}

/// A relay on loopback to `target` that records what its one client sends.
async fn recording_relay(target: String) -> (String, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let recorded = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = recorded.clone();
    tokio::spawn(async move {
        let (inbound, _) = listener.accept().await.unwrap();
        let outbound = tokio::net::TcpStream::connect(target).await.unwrap();
        let (mut from_client, mut to_client) = inbound.into_split();
        let (mut from_server, mut to_server) = outbound.into_split();
        tokio::spawn(async move { tokio::io::copy(&mut from_server, &mut to_client).await });
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from_client.read(&mut buffer).await {
            record.lock().unwrap().extend_from_slice(&buffer[..n]);
            if to_server.write_all(&buffer[..n]).await.is_err() {
                break;
            }
        }
    });
    (address, recorded)
}

/// Sends `bytes` on a fresh connection to `address` (then ends the sending side when
/// `then_eof`) and says whether the listener closed the connection within 3 s, well inside
/// its 10 s handshake deadline: without the end of stream, only a refusal closes it so soon.
async fn closed_after_sending(address: &str, bytes: &[u8], then_eof: bool) -> bool {
    use tokio::io::AsyncReadExt;
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let _ = stream.write_all(bytes).await;
    if then_eof {
        let _ = stream.shutdown().await;
    }
    let mut sink = vec![0u8; 64 * 1024];
    let drained = async { while let Ok(1..) = stream.read(&mut sink).await {} };
    tokio::time::timeout(Duration::from_secs(3), drained).await.is_ok()
}

#[tokio::test]
async fn a_truncated_record_and_a_replayed_connection_deliver_nothing() {
    let (served, mut inbox) = serve("t").await;
    let delivered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = delivered.clone();
    tokio::spawn(async move {
        while let Some(message) = inbox.recv().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if let Wire::Call(request, port) = message {
                let _ = port.send(wire::encode_ok(&request));
            }
        }
    });
    let delivered = || delivered.load(std::sync::atomic::Ordering::SeqCst);
    let tcp = served.server.address().tcp.clone();
    // A TLS handshake record that announces 16 KiB and ends after 100 bytes.
    let mut truncated = vec![0x16, 0x03, 0x01, 0x40, 0x00];
    truncated.extend_from_slice(&[1u8; 100]);
    assert!(
        closed_after_sending(&tcp, &truncated, true).await,
        "a truncated record cut off by the end of the stream is dropped"
    );

    // A call and a cast through a recording relay, then the whole connection sent again.
    let (relay, recorded) = recording_relay(tcp.clone()).await;
    let through_relay = CallAddress {
        tcp: relay,
        local: None,
    };
    let connection = connect(&served.tls, &through_relay, "n1").await.unwrap();
    let reply = connection.call(ACTOR, b"once", soon()).await.ok().unwrap();
    assert_eq!(answer(reply), Ok(b"once".to_vec()));
    assert!(connection.cast(ACTOR, b"cast once").await.is_ok());
    support_eventually(|| delivered() == 2).await;
    let session = recorded.lock().unwrap().clone();
    assert!(
        session.len() > 100,
        "the relay recorded the connection ({} bytes)",
        session.len()
    );
    assert!(
        closed_after_sending(&tcp, &session, false).await,
        "the replay is refused at once"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(delivered(), 2, "a replayed call or cast never reaches the actor");

    let fresh = open(&served).await;
    assert!(fresh.call(ACTOR, b"ok", soon()).await.is_ok(), "the listener serves on");
}

/// Waits up to 10 s for `done`.
async fn support_eventually(done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "not reached within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn silent_connections_from_one_address_hold_at_most_its_share_and_shut_no_one_else_out() {
    let (served, inbox) = serve("t").await;
    reverse_calls(inbox);
    let tcp = &served.server.address().tcp;
    let mut silent = Vec::new();
    for _ in 0..regatta_net::MAX_HANDSHAKES_PER_SOURCE {
        silent.push(tokio::net::TcpStream::connect(tcp).await.unwrap());
    }
    let mut byte = [0u8; 1];
    // One more from the same address is closed at once, not held to a deadline.
    let mut extra = tokio::net::TcpStream::connect(tcp).await.unwrap();
    let closed = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut extra, &mut byte),
    )
    .await
    .expect("the connection over the share is closed at once");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    // Those within the share are held, waiting for their handshake.
    let held = tokio::time::timeout(
        Duration::from_millis(300),
        tokio::io::AsyncReadExt::read(&mut silent[0], &mut byte),
    )
    .await;
    assert!(held.is_err(), "a connection within the share is held: {held:?}");
    // This host's processes still get in by the Unix socket meanwhile.
    let connection = open(&served).await;
    assert_eq!(connection.transport(), Transport::Unix);
    assert!(connection.call(ACTOR, b"ok", soon()).await.is_ok());
    // The slots come back when the silent ones close: TCP gets in again.
    drop(silent);
    let deadline = Instant::now() + Duration::from_secs(10);
    let tcp_only = CallAddress {
        local: None,
        ..served.server.address().clone()
    };
    loop {
        match connect(&served.tls, &tcp_only, "n1").await {
            Ok(connection) if connection.call(ACTOR, b"ok", soon()).await.is_ok() => break,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            _ => panic!("the slots never came back"),
        }
    }
}

#[tokio::test]
async fn calls_waiting_when_the_listener_stops_fail_at_once() {
    let (served, mut inbox) = serve("t").await;
    let connection = open(&served).await;
    let waiting = connection.call(ACTOR, b"x", soon());
    let stop = async {
        // Once the call is queued, stop serving (the host never answers).
        let queued = inbox.recv().await;
        drop(served);
        queued
    };
    let started = Instant::now();
    let (outcome, _queued) = tokio::join!(waiting, stop);
    assert!(matches!(outcome, Err(Unsent::Failed(CallError::Unreachable(_)))));
    assert!(started.elapsed() < Duration::from_secs(5), "not left to its timeout");
    assert!(!connection.is_open());
    // Nothing more is sent on it (the caller may take another path).
    assert!(matches!(
        connection.call(ACTOR, b"y", soon()).await,
        Err(Unsent::NotSent)
    ));
    assert!(matches!(connection.cast(ACTOR, b"z").await, Err(Unsent::NotSent)));
}

#[tokio::test]
async fn a_send_cut_off_part_way_breaks_the_connection_and_nothing_follows_it() {
    // A peer that completes the handshake and then never reads.
    let tls = tls_for("t");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = CallAddress {
        tcp: listener.local_addr().unwrap().to_string(),
        local: None,
    };
    let acceptor = tls.acceptor.clone();
    let stuck = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let _tls = acceptor.accept(stream).await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
    let connection = connect(&tls, &address, "n1").await.unwrap();
    // Larger than the socket buffers: the write stalls part-way and the deadline cuts it.
    let big = vec![1u8; wire::MAX_MESSAGE_BYTES];
    let outcome = connection
        .call(ACTOR, &big, Instant::now() + Duration::from_millis(300))
        .await;
    assert!(matches!(outcome, Err(Unsent::Failed(CallError::Timeout))));
    assert!(!connection.is_open(), "a partial frame must end the connection");
    assert!(matches!(
        connection.call(ACTOR, b"x", soon()).await,
        Err(Unsent::NotSent)
    ));
    stuck.abort();
}

#[tokio::test]
async fn a_call_that_times_out_waiting_behind_another_leaves_the_connection_open() {
    let (served, inbox) = serve("t").await;
    reverse_calls(inbox);
    let connection = open_tcp(&served).await;
    let big = vec![2u8; wire::MAX_MESSAGE_BYTES];
    // The small call's deadline passes while the big one holds the writer (or right
    // after): either way it was never cut off mid-frame.
    let (big_call, small) = tokio::join!(
        connection.call(ACTOR, &big, soon()),
        connection.call(ACTOR, b"s", Instant::now() + Duration::from_micros(1)),
    );
    assert!(big_call.is_ok());
    assert!(matches!(small, Err(Unsent::Failed(CallError::Timeout)) | Ok(_)));
    assert!(connection.is_open());
    assert!(connection.call(ACTOR, b"ok", soon()).await.is_ok());
}

#[test]
fn the_call_path_is_parsed_at_the_edge() {
    assert_eq!(CallPath::parse("").unwrap(), CallPath::Direct);
    assert_eq!(CallPath::parse("direct").unwrap(), CallPath::Direct);
    assert_eq!(CallPath::parse(" session ").unwrap(), CallPath::Session);
    assert_eq!(CallPath::parse("tcp").unwrap(), CallPath::Tcp);
    assert!(CallPath::parse("quic")
        .unwrap_err()
        .to_string()
        .contains("REGATTA_CALL_PATH"));
}
