//! Where one call's time goes, hop by hop: [`CallTiming`], from
//! [`ActorHandle::call_timed`](super::ActorHandle::call_timed).

use std::time::Duration;

use crate::net::calls::Hops;

/// The time one call spent in each hop from the caller to the actor and back, measured by
/// stamps both processes take on the host's one clock (the system clock).
///
/// The hops follow one another, so they add up to [`CallTiming::total`]. Stamps from two
/// hosts are only as comparable as the hosts' clocks are synchronised: read the cross-process
/// hops (`to_server`, `to_caller`) of a call between hosts as rough.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTiming {
    /// From the call until the channel was asked to send it: finding the actor's node
    /// (cached after the first call), encoding the request, opening the connection on a
    /// first call to that node, and any wait and retry after a "not hosted here" answer.
    pub prepare: Duration,
    /// Writing the request frame: taking the connection, TLS encryption, the write.
    pub send: Duration,
    /// From the write until the serving process had read and decrypted the request: the
    /// kernel's delivery and the wake-up of the serving connection's task.
    pub to_server: Duration,
    /// Handing the request to the actor's queue.
    pub enqueue: Duration,
    /// From the actor's queue until the serving connection held the answer: the host
    /// task's wake-up, the actor's handler, encoding the reply and waking the connection's
    /// task again.
    pub actor: Duration,
    /// From the answer until the reply frame was about to be written.
    pub reply_frame: Duration,
    /// From there until this process's connection reader had read the reply: TLS
    /// encryption, the write, the kernel's delivery, the reader's wake-up and decryption.
    pub to_caller: Duration,
    /// Handing the reply from the connection's reader to the calling task.
    pub wake_caller: Duration,
    /// Decoding the reply.
    pub decode: Duration,
}

impl CallTiming {
    /// The hops with their names, in the order a call passes them.
    pub fn hops(&self) -> [(&'static str, Duration); 9] {
        [
            ("prepare", self.prepare),
            ("send", self.send),
            ("to_server", self.to_server),
            ("enqueue", self.enqueue),
            ("actor", self.actor),
            ("reply_frame", self.reply_frame),
            ("to_caller", self.to_caller),
            ("wake_caller", self.wake_caller),
            ("decode", self.decode),
        ]
    }

    /// The whole call: the sum of the hops.
    pub fn total(&self) -> Duration {
        self.hops().iter().map(|(_, hop)| *hop).sum()
    }

    /// The timing of a call that entered at `called` and was decoded at `decoded` (wall
    /// clock nanoseconds) with the channel's stamps `hops`. A clock that stepped back
    /// between two stamps reads as a zero hop rather than a negative one.
    pub(crate) fn from_stamps(called: u64, hops: &Hops, decoded: u64) -> Self {
        let between = |from: u64, to: u64| Duration::from_nanos(to.saturating_sub(from));
        let server = &hops.server;
        Self {
            prepare: between(called, hops.start),
            send: between(hops.start, hops.sent),
            to_server: between(hops.sent, server.read),
            enqueue: between(server.read, server.queued),
            actor: between(server.queued, server.answered),
            reply_frame: between(server.answered, server.writing),
            to_caller: between(server.writing, hops.received),
            wake_caller: between(hops.received, hops.woken),
            decode: between(hops.woken, decoded),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::calls::ServerStamps;

    #[test]
    fn each_hop_is_the_gap_between_its_stamps_and_they_add_up_to_the_whole_call() {
        let hops = Hops {
            start: 110,
            sent: 130,
            server: ServerStamps {
                read: 170,
                queued: 175,
                answered: 275,
                writing: 280,
            },
            received: 330,
            woken: 345,
        };
        let timing = CallTiming::from_stamps(100, &hops, 350);
        let nanos: Vec<u64> = timing.hops().iter().map(|(_, d)| d.as_nanos() as u64).collect();
        assert_eq!(nanos, [10, 20, 40, 5, 100, 5, 50, 15, 5]);
        assert_eq!(timing.total(), Duration::from_nanos(250));
    }

    #[test]
    fn a_clock_stepping_back_gives_a_zero_hop_not_a_wrapped_one() {
        let hops = Hops {
            start: 100,
            sent: 120,
            server: ServerStamps {
                read: 90,
                queued: 95,
                answered: 96,
                writing: 97,
            },
            received: 130,
            woken: 131,
        };
        let timing = CallTiming::from_stamps(100, &hops, 132);
        assert_eq!(timing.to_server, Duration::ZERO);
        assert_eq!(timing.to_caller, Duration::from_nanos(33));
        assert!(timing.total() < Duration::from_micros(1));
    }
}
