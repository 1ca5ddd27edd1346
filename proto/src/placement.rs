//! Placement: which node (or placement-group bundle) an actor goes to, and where the bundles
//! of a placement group go. Pure data in, decisions out: no sockets, no clock.
//!
//! A [`Ledger`] tracks one node's (or one bundle's) total and available resources plus the
//! free share of each GPU index, so that two actors never get the same GPU unless both asked
//! for a fraction of one.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::resources::{format_fixed, Resources, GPU, UNIT};

/// How the bundles of a placement group are spread over nodes (Ray's four strategies).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    /// As few nodes as possible, more when needed.
    Pack,
    /// As many distinct nodes as possible, fewer when needed.
    Spread,
    /// All bundles on one node, or wait.
    StrictPack,
    /// Every bundle on a different node, or wait.
    StrictSpread,
}

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(text: &str) -> Result<Self, Error> {
        match text.to_ascii_uppercase().replace('-', "_").as_str() {
            "PACK" => Ok(Self::Pack),
            "SPREAD" => Ok(Self::Spread),
            "STRICT_PACK" => Ok(Self::StrictPack),
            "STRICT_SPREAD" => Ok(Self::StrictSpread),
            _ => Err(Error::UnknownStrategy {
                input: text.to_string(),
            }),
        }
    }
}

/// One GPU index and the share of it still free (fixed point, [`UNIT`] = the whole device).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSlot {
    /// Device index on the node.
    pub index: u32,
    /// The share this ledger owns of the device (a node owns all of it).
    pub cap: u64,
    /// Free share of the device.
    pub free: u64,
}

/// What one allocation took from a ledger, so that it can be given back exactly.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// The amounts taken.
    pub resources: Resources,
    /// GPU indices and the share taken from each.
    pub gpus: Vec<(u32, u64)>,
}

impl Allocation {
    /// The GPU indices this allocation holds, in order.
    pub fn gpu_ids(&self) -> Vec<u32> {
        self.gpus.iter().map(|(index, _)| *index).collect()
    }
}

/// Total and available resources of a node or of a reserved bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    total: Resources,
    available: Resources,
    gpus: Vec<GpuSlot>,
}

impl Ledger {
    /// A node's ledger: GPU indices `0..GPU` are created from the whole GPU count.
    pub fn for_node(total: Resources) -> Self {
        let count = total.fixed(GPU) / UNIT;
        let gpus = (0..count as u32)
            .map(|index| GpuSlot {
                index,
                cap: UNIT,
                free: UNIT,
            })
            .collect();
        Self {
            available: total.clone(),
            total,
            gpus,
        }
    }

    /// A bundle's ledger: exactly what its reservation took from a node.
    pub fn for_bundle(reserved: &Allocation) -> Self {
        Self {
            total: reserved.resources.clone(),
            available: reserved.resources.clone(),
            gpus: reserved
                .gpus
                .iter()
                .map(|(index, share)| GpuSlot {
                    index: *index,
                    cap: *share,
                    free: *share,
                })
                .collect(),
        }
    }

    /// Total resources.
    pub fn total(&self) -> &Resources {
        &self.total
    }

    /// Resources not allocated.
    pub fn available(&self) -> &Resources {
        &self.available
    }

    /// Resources in use (total minus available).
    pub fn used(&self) -> Resources {
        let mut used = self.total.clone();
        used.subtract(&self.available);
        used
    }

    /// Whether `request` could ever fit here, with nothing else allocated.
    pub fn could_fit(&self, request: &Resources) -> bool {
        Ledger::for_clone_of_total(self).allocate(request).is_some()
    }

    /// The same ledger with nothing allocated.
    fn for_clone_of_total(&self) -> Self {
        let mut fresh = self.clone();
        fresh.available = fresh.total.clone();
        for slot in &mut fresh.gpus {
            slot.free = slot.cap;
        }
        fresh
    }

    /// Whether `request` fits now ([`Ledger::allocate`] would succeed), without taking it.
    pub fn fits_now(&self, request: &Resources) -> bool {
        self.available.covers(request) && self.choose_gpus(request.fixed(GPU)).is_some()
    }

    /// Takes `request` from this ledger, choosing GPU indices; `None` if it does not fit now.
    pub fn allocate(&mut self, request: &Resources) -> Option<Allocation> {
        if !self.available.covers(request) {
            return None;
        }
        let gpus = self.choose_gpus(request.fixed(GPU))?;
        for (index, share) in &gpus {
            if let Some(slot) = self.gpus.iter_mut().find(|slot| slot.index == *index) {
                slot.free -= share;
            }
        }
        self.available.subtract(request);
        Some(Allocation {
            resources: request.clone(),
            gpus,
        })
    }

    /// Gives an allocation back.
    pub fn release(&mut self, allocation: &Allocation) {
        self.available.add(&allocation.resources);
        for (index, share) in &allocation.gpus {
            if let Some(slot) = self.gpus.iter_mut().find(|slot| slot.index == *index) {
                slot.free += share;
            }
        }
    }

    /// Picks GPU indices for `amount`: whole free devices for whole amounts, and for a
    /// fraction the fullest device that still has room (so fractions pack together).
    fn choose_gpus(&self, amount: u64) -> Option<Vec<(u32, u64)>> {
        if amount == 0 {
            return Some(Vec::new());
        }
        if amount < UNIT {
            return self
                .gpus
                .iter()
                .filter(|slot| slot.free >= amount)
                .min_by_key(|slot| (slot.free, slot.index))
                .map(|slot| vec![(slot.index, amount)]);
        }
        if !amount.is_multiple_of(UNIT) {
            return None;
        }
        let wanted = (amount / UNIT) as usize;
        let whole: Vec<(u32, u64)> = self
            .gpus
            .iter()
            .filter(|slot| slot.free >= UNIT)
            .take(wanted)
            .map(|slot| (slot.index, UNIT))
            .collect();
        (whole.len() == wanted).then_some(whole)
    }

    /// Share of the busiest requested resource after placing `request`: lower is emptier.
    pub(crate) fn load_after(&self, request: &Resources) -> u64 {
        let mut names: BTreeSet<&str> = request.iter().map(|(name, _)| name).collect();
        if names.is_empty() {
            names = self.total.iter().map(|(name, _)| name).collect();
        }
        names
            .into_iter()
            .filter(|name| self.total.fixed(name) > 0)
            .map(|name| {
                let total = self.total.fixed(name);
                let used = total - self.available.fixed(name) + request.fixed(name);
                used.saturating_mul(UNIT) / total
            })
            .max()
            .unwrap_or(0)
    }
}

/// Checks the shape of a request before placement: GPU amounts above one must be whole.
pub fn validate_request(request: &Resources) -> Result<(), Error> {
    let gpu = request.fixed(GPU);
    if gpu > UNIT && !gpu.is_multiple_of(UNIT) {
        return Err(Error::GpuRequestNotWhole { gpu });
    }
    Ok(())
}

/// Most whole GPUs one node may declare (each becomes an index the head tracks).
pub const MAX_GPUS_PER_NODE: u64 = 256;

/// Checks a node's declared capacity: GPUs are whole devices, and a sane number of them.
pub fn validate_capacity(capacity: &Resources) -> Result<(), Error> {
    let gpu = capacity.fixed(GPU);
    if !gpu.is_multiple_of(UNIT) {
        return Err(Error::NodeGpuNotWhole { gpu });
    }
    if gpu / UNIT > MAX_GPUS_PER_NODE {
        return Err(Error::TooManyGpus {
            gpu,
            max: MAX_GPUS_PER_NODE,
        });
    }
    Ok(())
}

/// A node as the placement logic sees it.
#[derive(Clone, Copy, Debug)]
pub struct Candidate<'a> {
    /// The node's name.
    pub node: &'a str,
    /// Its ledger.
    pub ledger: &'a Ledger,
    /// Actors it hosts now, used to break ties so that empty requests spread out (by the
    /// linear scan the scheduler's index is checked against).
    #[cfg(test)]
    pub actors: usize,
}

/// The outcome of trying to place something.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision<T> {
    /// Place it here.
    Place(T),
    /// It fits the cluster's totals but not what is free now: wait.
    Busy,
    /// No node could ever hold it: the message says what is missing.
    Infeasible(String),
}

/// Picks the least-loaded node that can hold `request` now, by a linear scan: the reference
/// the scheduler's placement index is checked against.
#[cfg(test)]
pub fn place_actor(candidates: &[Candidate<'_>], request: &Resources) -> Decision<String> {
    let best = candidates
        .iter()
        .filter(|c| c.ledger.fits_now(request))
        .min_by_key(|c| (c.ledger.load_after(request), c.actors, c.node));
    if let Some(best) = best {
        return Decision::Place(best.node.to_string());
    }
    if candidates.iter().any(|c| c.ledger.could_fit(request)) {
        Decision::Busy
    } else {
        Decision::Infeasible(describe_missing(candidates, request))
    }
}

/// Explains why no node can hold `request`, naming each resource that falls short.
pub fn describe_missing(candidates: &[Candidate<'_>], request: &Resources) -> String {
    if candidates.is_empty() {
        return format!("no alive node to place {request} on; start a worker");
    }
    let mut short = Vec::new();
    for (name, amount) in request.iter() {
        let best = candidates
            .iter()
            .map(|c| (c.ledger.total.fixed(name), c.node))
            .max_by_key(|(total, node)| (*total, std::cmp::Reverse(*node)));
        if let Some((largest, node)) = best {
            if largest < amount {
                short.push(if largest == 0 {
                    format!("no node has {name}")
                } else {
                    format!(
                        "no node has {name}={} (largest: {name}={} on node {node})",
                        format_fixed(amount),
                        format_fixed(largest)
                    )
                });
            }
        }
    }
    if short.is_empty() {
        format!("no single node has all of {request}; lower the request or add a node")
    } else {
        format!("{}; lower the request or add a node", short.join(", "))
    }
}

/// Picks a node for each bundle of a placement group, all or nothing.
pub fn place_bundles(candidates: &[Candidate<'_>], bundles: &[Resources], strategy: Strategy) -> Decision<Vec<String>> {
    if bundles.is_empty() {
        return Decision::Infeasible("a placement group needs at least one bundle".into());
    }
    let now = assign(candidates, bundles, strategy, |ledger| ledger.clone());
    if let Some(nodes) = now {
        return Decision::Place(nodes);
    }
    let ever = assign(candidates, bundles, strategy, Ledger::for_clone_of_total);
    if ever.is_some() {
        return Decision::Busy;
    }
    Decision::Infeasible(explain_bundles(candidates, bundles, strategy))
}

fn explain_bundles(candidates: &[Candidate<'_>], bundles: &[Resources], strategy: Strategy) -> String {
    if strategy == Strategy::StrictSpread && bundles.len() > candidates.len() {
        return format!(
            "STRICT_SPREAD needs {} distinct nodes but {} are alive; use fewer bundles, SPREAD, or add nodes",
            bundles.len(),
            candidates.len()
        );
    }
    for bundle in bundles {
        if !candidates.iter().any(|c| c.ledger.could_fit(bundle)) {
            return format!("bundle {bundle}: {}", describe_missing(candidates, bundle));
        }
    }
    let mut sum = Resources::new();
    bundles.iter().for_each(|b| sum.add(b));
    format!("no arrangement of the bundles fits with {strategy:?} (together they need {sum}); lower the bundles or add nodes")
}

/// Tries to assign every bundle to a node under `strategy`, on ledgers made by `start`.
fn assign(
    candidates: &[Candidate<'_>],
    bundles: &[Resources],
    strategy: Strategy,
    start: impl Fn(&Ledger) -> Ledger,
) -> Option<Vec<String>> {
    let mut ledgers: BTreeMap<&str, Ledger> = candidates.iter().map(|c| (c.node, start(c.ledger))).collect();
    match strategy {
        Strategy::StrictPack => pack_on_one(&ledgers, bundles),
        Strategy::Pack => pack_on_one(&ledgers, bundles).or_else(|| greedy(&mut ledgers, bundles, Prefer::Used)),
        Strategy::Spread => greedy(&mut ledgers, bundles, Prefer::Unused),
        Strategy::StrictSpread => {
            let names: Vec<&str> = ledgers.keys().copied().collect();
            let mut chosen = vec![None; bundles.len()];
            distinct(&mut ledgers, &names, bundles, 0, &mut chosen).then(|| chosen.into_iter().flatten().collect())
        }
    }
}

fn pack_on_one(ledgers: &BTreeMap<&str, Ledger>, bundles: &[Resources]) -> Option<Vec<String>> {
    // Prefer the fullest node that still fits everything, so emptier nodes stay free. Only
    // the ledger being tried is copied.
    let nothing = Resources::new();
    let mut order: Vec<(std::cmp::Reverse<u64>, &str)> = ledgers
        .iter()
        .map(|(node, ledger)| (std::cmp::Reverse(ledger.load_after(&nothing)), *node))
        .collect();
    order.sort_unstable();
    for (_, node) in order {
        let mut ledger = ledgers.get(node)?.clone();
        if bundles.iter().all(|bundle| ledger.allocate(bundle).is_some()) {
            return Some(vec![node.to_string(); bundles.len()]);
        }
    }
    None
}

enum Prefer {
    Used,
    Unused,
}

impl Prefer {
    /// Orders nodes by how many bundles of this group they already hold.
    fn rank(&self, count: usize) -> usize {
        match self {
            Prefer::Used => usize::MAX - count,
            Prefer::Unused => count,
        }
    }
}

fn greedy(ledgers: &mut BTreeMap<&str, Ledger>, bundles: &[Resources], prefer: Prefer) -> Option<Vec<String>> {
    if bundles.windows(2).all(|pair| pair[0] == pair[1]) {
        return greedy_alike(ledgers, &bundles[0], bundles.len(), &prefer);
    }
    greedy_scan(ledgers, bundles, prefer)
}

/// [`greedy_scan`] for `count` identical bundles (the common case), in O(nodes log nodes):
/// each step takes the best node from a heap, and only that node's key changes (a node
/// that cannot take the bundle now never can later in the same group, since placing only
/// takes resources).
fn greedy_alike(
    ledgers: &mut BTreeMap<&str, Ledger>,
    bundle: &Resources,
    count: usize,
    prefer: &Prefer,
) -> Option<Vec<String>> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut heap: BinaryHeap<Reverse<(usize, u64, &str)>> = ledgers
        .iter()
        .filter(|(_, ledger)| ledger.fits_now(bundle))
        .map(|(node, ledger)| Reverse((prefer.rank(0), ledger.load_after(bundle), *node)))
        .collect();
    let mut uses: BTreeMap<&str, usize> = BTreeMap::new();
    let mut placed = Vec::with_capacity(count);
    for _ in 0..count {
        let Reverse((_, _, node)) = heap.pop()?;
        let ledger = ledgers.get_mut(node)?;
        ledger.allocate(bundle)?;
        let used = uses.entry(node).or_insert(0);
        *used += 1;
        placed.push(node.to_string());
        if ledger.fits_now(bundle) {
            heap.push(Reverse((prefer.rank(*used), ledger.load_after(bundle), node)));
        }
    }
    Some(placed)
}

/// Each bundle in turn on the best node for it now: by how many of the group's bundles it
/// holds (see [`Prefer`]), then load after placing, then name.
fn greedy_scan(ledgers: &mut BTreeMap<&str, Ledger>, bundles: &[Resources], prefer: Prefer) -> Option<Vec<String>> {
    let mut placed: Vec<String> = Vec::with_capacity(bundles.len());
    for bundle in bundles {
        let uses = |node: &str| placed.iter().filter(|p| p.as_str() == node).count();
        let choice = ledgers
            .iter()
            .filter(|(_, ledger)| ledger.fits_now(bundle))
            .min_by_key(|(node, ledger)| (prefer.rank(uses(node)), ledger.load_after(bundle), **node))
            .map(|(node, _)| *node)?;
        ledgers.get_mut(choice)?.allocate(bundle)?;
        placed.push(choice.to_string());
    }
    Some(placed)
}

/// Backtracking search for distinct nodes, one per bundle (bundles are few).
fn distinct(
    ledgers: &mut BTreeMap<&str, Ledger>,
    names: &[&str],
    bundles: &[Resources],
    at: usize,
    chosen: &mut Vec<Option<String>>,
) -> bool {
    if at == bundles.len() {
        return true;
    }
    let mut options: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !chosen.iter().flatten().any(|c| c == n))
        .filter(|n| ledgers[n].clone().allocate(&bundles[at]).is_some())
        .collect();
    options.sort_by_key(|n| (ledgers[n].load_after(&bundles[at]), *n));
    for node in options {
        chosen[at] = Some(node.to_string());
        if distinct(ledgers, names, bundles, at + 1, chosen) {
            return true;
        }
        chosen[at] = None;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(text: &str) -> Ledger {
        Ledger::for_node(Resources::parse_capacity(text).unwrap())
    }

    fn req(text: &str) -> Resources {
        Resources::parse_request(text).unwrap()
    }

    fn cands<'a>(nodes: &'a [(&'a str, Ledger)]) -> Vec<Candidate<'a>> {
        nodes
            .iter()
            .map(|(node, ledger)| Candidate {
                node,
                ledger,
                actors: 0,
            })
            .collect()
    }

    #[test]
    fn whole_gpus_are_never_shared() {
        let mut node = ledger("CPU=4,GPU=2");
        let a = node.allocate(&req("GPU=1")).unwrap();
        let b = node.allocate(&req("GPU=1")).unwrap();
        assert_ne!(a.gpu_ids(), b.gpu_ids());
        assert!(node.allocate(&req("GPU=1")).is_none());
        node.release(&a);
        assert_eq!(node.allocate(&req("GPU=1")).unwrap().gpu_ids(), a.gpu_ids());
    }

    #[test]
    fn fractional_gpus_pack_onto_one_device() {
        let mut node = ledger("GPU=2");
        let a = node.allocate(&req("GPU=0.5")).unwrap();
        let b = node.allocate(&req("GPU=0.5")).unwrap();
        assert_eq!(a.gpu_ids(), b.gpu_ids());
        let whole = node.allocate(&req("GPU=1")).unwrap();
        assert_ne!(whole.gpu_ids(), a.gpu_ids());
        assert!(node.allocate(&req("GPU=0.1")).is_none());
    }

    #[test]
    fn a_whole_gpu_is_not_carved_from_a_partly_used_one() {
        let mut node = ledger("GPU=1");
        node.allocate(&req("GPU=0.3")).unwrap();
        assert!(node.allocate(&req("GPU=1")).is_none());
        assert!(node.could_fit(&req("GPU=1")));
    }

    #[test]
    fn infeasible_request_names_what_is_missing() {
        let nodes = [("w1", ledger("CPU=4,GPU=4")), ("w2", ledger("CPU=4"))];
        match place_actor(&cands(&nodes), &req("GPU=8,accelerator_type:H100")) {
            Decision::Infeasible(msg) => {
                assert!(msg.contains("GPU=8 (largest: GPU=4 on node w1)"), "{msg}");
                assert!(msg.contains("no node has accelerator_type:H100"), "{msg}");
            }
            other => panic!("expected infeasible, got {other:?}"),
        }
    }

    #[test]
    fn busy_request_waits_rather_than_failing() {
        let mut full = ledger("CPU=2");
        full.allocate(&req("CPU=2")).unwrap();
        let nodes = [("w1", full)];
        assert_eq!(place_actor(&cands(&nodes), &req("CPU=1")), Decision::Busy);
    }

    #[test]
    fn actors_go_to_the_least_loaded_node() {
        let mut busy = ledger("CPU=4");
        busy.allocate(&req("CPU=3")).unwrap();
        let nodes = [("w1", busy), ("w2", ledger("CPU=4"))];
        assert_eq!(place_actor(&cands(&nodes), &req("CPU=1")), Decision::Place("w2".into()));
    }

    #[test]
    fn strict_spread_uses_distinct_nodes_or_is_infeasible() {
        let nodes = [
            ("w1", ledger("CPU=8")),
            ("w2", ledger("CPU=8")),
            ("w3", ledger("CPU=8")),
        ];
        let bundles = vec![req("CPU=1"); 3];
        match place_bundles(&cands(&nodes), &bundles, Strategy::StrictSpread) {
            Decision::Place(placed) => {
                let distinct: BTreeSet<_> = placed.iter().collect();
                assert_eq!(distinct.len(), 3);
            }
            other => panic!("{other:?}"),
        }
        let four = vec![req("CPU=1"); 4];
        assert!(matches!(
            place_bundles(&cands(&nodes), &four, Strategy::StrictSpread),
            Decision::Infeasible(msg) if msg.contains("4 distinct nodes")
        ));
    }

    #[test]
    fn strict_spread_backtracks_past_a_greedy_dead_end() {
        // The big bundle only fits w2; a greedy pass that gave w2 to the small one would fail.
        let nodes = [("w1", ledger("CPU=1")), ("w2", ledger("CPU=4"))];
        let bundles = vec![req("CPU=1"), req("CPU=4")];
        assert_eq!(
            place_bundles(&cands(&nodes), &bundles, Strategy::StrictSpread),
            Decision::Place(vec!["w1".into(), "w2".into()])
        );
    }

    #[test]
    fn pack_stays_on_one_node_when_it_fits() {
        let nodes = [("w1", ledger("CPU=8")), ("w2", ledger("CPU=8"))];
        let bundles = vec![req("CPU=2"); 3];
        match place_bundles(&cands(&nodes), &bundles, Strategy::Pack) {
            Decision::Place(placed) => assert!(placed.iter().all(|n| n == &placed[0])),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn pack_spills_over_but_strict_pack_waits_or_fails() {
        let nodes = [("w1", ledger("CPU=2")), ("w2", ledger("CPU=2"))];
        let bundles = vec![req("CPU=2"); 2];
        assert!(matches!(
            place_bundles(&cands(&nodes), &bundles, Strategy::Pack),
            Decision::Place(p) if p[0] != p[1]
        ));
        assert!(matches!(
            place_bundles(&cands(&nodes), &bundles, Strategy::StrictPack),
            Decision::Infeasible(_)
        ));
        let mut half = ledger("CPU=4");
        half.allocate(&req("CPU=3")).unwrap();
        let busy = [("w1", half)];
        assert_eq!(
            place_bundles(&cands(&busy), &bundles, Strategy::StrictPack),
            Decision::Busy
        );
    }

    #[test]
    fn spread_prefers_unused_nodes() {
        let nodes = [("w1", ledger("CPU=8")), ("w2", ledger("CPU=8"))];
        let bundles = vec![req("CPU=1"); 2];
        assert!(matches!(
            place_bundles(&cands(&nodes), &bundles, Strategy::Spread),
            Decision::Place(p) if p[0] != p[1]
        ));
    }

    #[test]
    fn bundle_ledger_hands_out_only_its_reserved_gpus() {
        let mut node = ledger("GPU=4");
        let reserved = node.allocate(&req("GPU=2")).unwrap();
        let mut bundle = Ledger::for_bundle(&reserved);
        let a = bundle.allocate(&req("GPU=1")).unwrap();
        let b = bundle.allocate(&req("GPU=1")).unwrap();
        let mut got = a.gpu_ids();
        got.extend(b.gpu_ids());
        got.sort();
        assert_eq!(got, reserved.gpu_ids());
        assert!(bundle.allocate(&req("GPU=1")).is_none());
    }

    /// Identical bundles take the heap path; on random clusters it chooses exactly what
    /// the bundle-by-bundle scan chooses, for both preferences.
    #[test]
    fn alike_bundles_are_placed_as_the_scan_places_them() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..300 {
            let names: Vec<String> = (0..1 + next(20)).map(|i| format!("n{i:02}")).collect();
            let mut ledgers: BTreeMap<&str, Ledger> = BTreeMap::new();
            for name in &names {
                let capacity = format!("CPU={},GPU={}", 1 + next(6), next(3));
                let mut ledger = Ledger::for_node(Resources::parse_capacity(&capacity).unwrap());
                for _ in 0..next(3) {
                    let _ = ledger.allocate(&Resources::parse_request("CPU=1").unwrap());
                }
                ledgers.insert(name, ledger);
            }
            let bundle =
                Resources::parse_request(["CPU=1", "CPU=2", "GPU=1", "CPU=1,GPU=0.5"][next(4) as usize]).unwrap();
            let count = 1 + next(12) as usize;
            for (prefer, again) in [(Prefer::Used, Prefer::Used), (Prefer::Unused, Prefer::Unused)] {
                let heap = greedy_alike(&mut ledgers.clone(), &bundle, count, &prefer);
                let scan = greedy_scan(&mut ledgers.clone(), &vec![bundle.clone(); count], again);
                assert_eq!(heap, scan, "round {round}: {count} x {bundle}");
            }
        }
    }

    #[test]
    fn node_capacity_must_be_whole_and_sane_gpus() {
        let cap = |t: &str| Resources::parse_capacity(t).unwrap();
        assert!(validate_capacity(&cap("CPU=8,GPU=8")).is_ok());
        let fraction = validate_capacity(&cap("GPU=1.5")).unwrap_err();
        assert_eq!(fraction, Error::NodeGpuNotWhole { gpu: 3 * UNIT / 2 });
        assert_eq!(
            fraction.to_string(),
            "GPU=1.5 is not allowed on a node: declare whole GPUs"
        );
        let many = validate_capacity(&cap("GPU=1000000000")).unwrap_err();
        assert!(matches!(many, Error::TooManyGpus { max: 256, .. }), "{many}");
        assert!(many.to_string().contains("more than 256"), "{many}");
    }

    #[test]
    fn fractional_gpu_above_one_is_rejected() {
        let refused = validate_request(&req("GPU=1.5")).unwrap_err();
        assert_eq!(refused, Error::GpuRequestNotWhole { gpu: 3 * UNIT / 2 });
        assert_eq!(
            refused.to_string(),
            "GPU=1.5 is not allowed: ask for a fraction of one GPU (below 1) or a whole number"
        );
        assert!(validate_request(&req("GPU=0.5")).is_ok());
        assert!(validate_request(&req("GPU=2")).is_ok());
    }

    #[test]
    fn strategies_parse_from_rays_names_and_refuse_others_by_name() {
        assert_eq!("strict-spread".parse::<Strategy>(), Ok(Strategy::StrictSpread));
        assert_eq!("PACK".parse::<Strategy>(), Ok(Strategy::Pack));
        let unknown = "EVERYWHERE".parse::<Strategy>().unwrap_err();
        assert_eq!(
            unknown,
            Error::UnknownStrategy {
                input: "EVERYWHERE".into()
            }
        );
        assert_eq!(
            unknown.to_string(),
            "unknown placement strategy 'EVERYWHERE'; use PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"
        );
    }
}
