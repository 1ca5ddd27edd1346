//! Broadcasting one object to many nodes as a tree. When many nodes pull a large object at
//! once, each holder serves at most `per_source` network pulls at a time; the other pullers
//! wait until a holder's share frees (a pull ends, and every finished pull is a new
//! source), so copies spread 1 → 1+k → (1+k)² … and the first holder sends at most k copies
//! per round instead of one per node. Ray's push-based broadcast bounds a holder's outbound
//! transfers the same way.
//!
//! Pulls between nodes that advertise the same host are not limited: they map the
//! holder's shared memory or ride loopback, so they cost no link. Pure bookkeeping: the
//! head asks it how to answer a pull, and again for the pulls it holds back whenever a pull
//! of that object ends, a node goes or the clock ticks (a lease lapses).

use std::collections::HashMap;

use super::directory::Location;
use super::id::ObjectId;

/// Objects smaller than this are pulled at once from any holder: a tree's rounds would
/// cost more latency than the sender's link time they save.
pub const FANOUT_MIN_BYTES: u64 = 16 << 20;

/// Network pulls one holder serves at once by default.
pub const DEFAULT_PER_SOURCE: usize = 2;

/// A pull counts against its holder's share for this long plus the object's time at
/// [`LEASE_BYTES_PER_MS`], unless its puller reports first that it ended (with a copy or
/// without). Pullers always report, so a lease lapses only for a puller that hangs, or
/// whose report was lost: that is the longest it holds the others back.
const LEASE_BASE_MS: u64 = 5_000;

/// 25 MB/s, a fifth of a 1 Gbit/s link: the slowest transfer a lease allows for.
const LEASE_BYTES_PER_MS: u64 = 25_000;

/// How long an object's tally of pulls served is kept once no pull of it is under way.
const FORGET_AFTER_MS: u64 = 60_000;

/// How to answer a node about to pull an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Pull now, trying the sources in this order (the first is the one chosen).
    Go(Location),
    /// Every holder is serving its share: ask again when a copy appears.
    Wait,
}

/// A pull under way: from which holder, and when it stops counting.
#[derive(Clone, Debug)]
struct Pull {
    source: String,
    until_ms: u64,
}

/// One object's spread: the pulls under way by puller, and how many each holder served.
#[derive(Debug, Default)]
struct Spread {
    pulls: HashMap<String, Pull>,
    served: HashMap<String, u32>,
    touched_ms: u64,
}

/// The pulls of every object being spread.
#[derive(Debug, Default)]
pub struct Fanout {
    per_source: usize,
    spreads: HashMap<ObjectId, Spread>,
}

impl Fanout {
    /// At most `per_source` network pulls from one holder at once (0: no limit, every node
    /// pulls from the first holder as soon as it asks).
    pub fn new(per_source: usize) -> Self {
        Self {
            per_source,
            spreads: HashMap::new(),
        }
    }

    /// How `puller` (reached at `puller_address`) should pull `location`'s object: same-host
    /// holders first, else the least busy holder if it has room in its share (the pull is
    /// then counted against it), else wait. Among
    /// holders as busy, the one that served fewest goes first, so that new copies take the
    /// load off the first holder. A puller asking again (its last pull failed) no longer
    /// counts against its earlier holder.
    pub fn plan(
        &mut self,
        id: ObjectId,
        mut location: Location,
        puller: &str,
        puller_address: &str,
        now_ms: u64,
    ) -> Plan {
        if let Some(spread) = self.spreads.get_mut(&id) {
            spread.pulls.remove(puller);
            spread.pulls.retain(|_, pull| pull.until_ms > now_ms);
        }
        location.sources.retain(|(node, _)| node != puller);
        let limited = self.per_source > 0 && location.size >= FANOUT_MIN_BYTES;
        let (mut near, mut far): (Vec<_>, Vec<_>) = location
            .sources
            .drain(..)
            .partition(|(_, address)| same_host(address, puller_address));
        if !limited || !near.is_empty() || far.is_empty() {
            near.append(&mut far);
            location.sources = near;
            return Plan::Go(location);
        }
        let spread = self.spreads.entry(id).or_default();
        spread.touched_ms = now_ms;
        let load = |node: &str| spread.pulls.values().filter(|pull| pull.source == node).count();
        let served = |node: &str| spread.served.get(node).copied().unwrap_or(0);
        // Stable: among holders alike the directory's order stands.
        far.sort_by_key(|(node, _)| (load(node), served(node)));
        let chosen = far[0].0.clone();
        if load(&chosen) >= self.per_source {
            return Plan::Wait;
        }
        *spread.served.entry(chosen.clone()).or_default() += 1;
        spread.pulls.insert(
            puller.to_string(),
            Pull {
                source: chosen,
                until_ms: now_ms + lease_ms(location.size),
            },
        );
        location.sources = far;
        Plan::Go(location)
    }

    /// `node`'s pull of `id` ended (it reported its copy, or that it kept none).
    pub fn ended(&mut self, id: ObjectId, node: &str) {
        if let Some(spread) = self.spreads.get_mut(&id) {
            spread.pulls.remove(node);
        }
    }

    /// A node died: its pulls end, and pulls from it stop counting.
    pub fn node_gone(&mut self, node: &str) {
        for spread in self.spreads.values_mut() {
            spread
                .pulls
                .retain(|puller, pull| puller != node && pull.source != node);
            spread.served.remove(node);
        }
    }

    /// Drops the pulls whose lease lapsed (their puller went quiet, or kept no copy and
    /// did not say so), and the tallies of objects nobody pulled for a minute, so that
    /// nothing piles up for objects nobody pulls any more.
    pub fn expire(&mut self, now_ms: u64) {
        self.spreads.retain(|_, spread| {
            spread.pulls.retain(|_, pull| pull.until_ms > now_ms);
            !spread.pulls.is_empty() || now_ms < spread.touched_ms + FORGET_AFTER_MS
        });
    }

    /// Pulls under way, all objects together.
    #[cfg(test)]
    pub fn under_way(&self) -> usize {
        self.spreads.values().map(|spread| spread.pulls.len()).sum()
    }

    /// Objects whose spread is remembered.
    #[cfg(test)]
    pub fn objects(&self) -> usize {
        self.spreads.len()
    }
}

/// How long a pull of an object of `size` bytes counts against its holder's share.
pub fn lease_ms(size: u64) -> u64 {
    LEASE_BASE_MS + size / LEASE_BYTES_PER_MS
}

/// Whether two transfer addresses (`host:port`, `[v6]:port`) name the same host.
pub fn same_host(a: &str, b: &str) -> bool {
    let host = |address: &str| address.rsplit_once(':').map(|(host, _)| host.to_string());
    matches!((host(a), host(b)), (Some(a), Some(b)) if a == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIG: u64 = 1 << 30;

    fn location(size: u64, sources: &[&str]) -> Location {
        Location {
            size,
            checksum: 7,
            sources: sources.iter().map(|n| (n.to_string(), address(n))).collect(),
            spilled: None,
        }
    }

    /// Every node on its own host, except names starting with `h` that share host `10.0.0.1`.
    fn address(node: &str) -> String {
        match node.strip_prefix('h') {
            Some(_) => format!("10.0.0.1:{}", 7000 + node.len()),
            None => format!("10.1.{}.1:7000", node.bytes().map(u32::from).sum::<u32>() % 250),
        }
    }

    fn first(plan: &Plan) -> &str {
        match plan {
            Plan::Go(location) => &location.sources[0].0,
            Plan::Wait => panic!("waits"),
        }
    }

    #[test]
    fn same_host_compares_the_host_part_of_addresses() {
        assert!(same_host("127.0.0.1:5000", "127.0.0.1:6000"));
        assert!(!same_host("127.0.0.2:5000", "127.0.0.1:5000"));
        assert!(same_host("[::1]:5000", "[::1]:6000"));
        assert!(!same_host("node-a:1", "node-b:1"));
        assert!(!same_host("garbage", "garbage"), "no port, no host to compare");
    }

    #[test]
    fn a_holder_serves_its_share_then_pullers_wait_for_a_new_copy() {
        let id = ObjectId::random();
        let mut fanout = Fanout::new(2);
        let holder = location(BIG, &["a"]);
        assert_eq!(first(&fanout.plan(id, holder.clone(), "b", &address("b"), 0)), "a");
        assert_eq!(first(&fanout.plan(id, holder.clone(), "c", &address("c"), 0)), "a");
        assert_eq!(fanout.plan(id, holder.clone(), "d", &address("d"), 0), Plan::Wait);
        // b's copy arrives: b is a source, and a is busy with c only.
        fanout.ended(id, "b");
        let two = location(BIG, &["a", "b"]);
        assert_eq!(first(&fanout.plan(id, two.clone(), "d", &address("d"), 10)), "b");
        // As busy as a, b served fewer: it goes first.
        assert_eq!(first(&fanout.plan(id, two.clone(), "e", &address("e"), 10)), "b");
        assert_eq!(first(&fanout.plan(id, two.clone(), "f", &address("f"), 10)), "a");
        assert_eq!(fanout.plan(id, two, "g", &address("g"), 10), Plan::Wait);
        assert_eq!(fanout.under_way(), 4);
    }

    #[test]
    fn the_chosen_holder_comes_first_and_the_others_stay_as_fallbacks() {
        let id = ObjectId::random();
        let mut fanout = Fanout::new(1);
        let both = location(BIG, &["a", "b"]);
        fanout.plan(id, both.clone(), "c", &address("c"), 0);
        let Plan::Go(for_d) = fanout.plan(id, both, "d", &address("d"), 0) else {
            panic!("b is free")
        };
        let order: Vec<&str> = for_d.sources.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(order, ["b", "a"], "least busy first, the busy one as a fallback");
    }

    #[test]
    fn same_host_holders_small_objects_and_no_limit_are_not_held_back() {
        let id = ObjectId::random();
        let mut fanout = Fanout::new(1);
        fanout.plan(id, location(BIG, &["h1"]), "x", &address("x"), 0);
        // h22 shares h1's host: it maps h1's shared memory however busy h1 is.
        assert_eq!(
            first(&fanout.plan(id, location(BIG, &["h1"]), "h22", &address("h22"), 0)),
            "h1"
        );
        // A same-host holder goes before a free one elsewhere.
        let mixed = location(BIG, &["a", "h1"]);
        assert_eq!(first(&fanout.plan(id, mixed, "h333", &address("h333"), 0)), "h1");
        let small = ObjectId::random();
        for puller in ["p", "q", "r"] {
            let plan = fanout.plan(
                small,
                location(FANOUT_MIN_BYTES - 1, &["a"]),
                puller,
                &address(puller),
                0,
            );
            assert_eq!(first(&plan), "a");
        }
        let mut unlimited = Fanout::new(0);
        for puller in ["p", "q", "r"] {
            assert_eq!(
                first(&unlimited.plan(id, location(BIG, &["a"]), puller, &address(puller), 0)),
                "a"
            );
        }
        assert_eq!(unlimited.under_way(), 0, "nothing is counted without a limit");
    }

    #[test]
    fn a_lapsed_pull_a_retry_and_a_dead_node_free_the_holders_share() {
        let id = ObjectId::random();
        let mut fanout = Fanout::new(1);
        let one = location(BIG, &["a"]);
        fanout.plan(id, one.clone(), "b", &address("b"), 0);
        let lease = lease_ms(BIG);
        assert_eq!(fanout.plan(id, one.clone(), "c", &address("c"), lease - 1), Plan::Wait);
        assert_eq!(first(&fanout.plan(id, one.clone(), "c", &address("c"), lease)), "a");
        // c asks again (its pull failed): its old pull does not hold a's share against it.
        assert_eq!(first(&fanout.plan(id, one.clone(), "c", &address("c"), lease)), "a");
        assert_eq!(fanout.under_way(), 1);
        fanout.node_gone("c");
        assert_eq!(fanout.under_way(), 0);
        fanout.plan(id, one.clone(), "d", &address("d"), lease);
        fanout.node_gone("a");
        assert_eq!(fanout.under_way(), 0, "pulls from a dead holder stop counting");
        fanout.plan(id, one.clone(), "f", &address("f"), lease);
        fanout.expire(2 * lease - 1);
        assert_eq!(fanout.under_way(), 1);
        fanout.expire(2 * lease);
        assert_eq!(fanout.under_way(), 0, "a lapsed pull is dropped by the clock too");
        assert_eq!(fanout.objects(), 1, "its tally is kept a while");
        fanout.expire(lease + FORGET_AFTER_MS);
        assert_eq!(fanout.objects(), 0);
    }

    #[test]
    fn pulls_one_after_another_take_the_newest_copies_not_the_first_holder() {
        let id = ObjectId::random();
        let mut fanout = Fanout::new(1);
        let mut sources = vec!["a"];
        for (t, puller) in ["b", "c", "d"].into_iter().enumerate() {
            let plan = fanout.plan(id, location(BIG, &sources), puller, &address(puller), t as u64);
            let from = first(&plan).to_string();
            assert!(t == 0 || from != "a", "{puller} pulled from {from}");
            fanout.ended(id, puller);
            sources.push(puller);
        }
    }

    #[test]
    fn the_puller_is_never_its_own_source_and_a_spilled_only_object_goes_at_once() {
        let id = ObjectId::random();
        let mut fanout = Fanout::new(1);
        let Plan::Go(location) = fanout.plan(id, location(BIG, &["a", "b"]), "a", &address("a"), 0) else {
            panic!("b is free")
        };
        assert_eq!(location.sources.len(), 1);
        assert_eq!(location.sources[0].0, "b");
        let mut spilled = self::location(BIG, &[]);
        spilled.spilled = Some("file:///tmp/x".into());
        assert!(matches!(fanout.plan(id, spilled, "c", &address("c"), 0), Plan::Go(_)));
    }
}
