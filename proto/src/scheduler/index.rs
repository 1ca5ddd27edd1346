//! The placement index: for each request shape placed recently (an actor kind and its
//! resources), the alive nodes it fits on now, ordered the way
//! [`crate::placement::place_actor`] chooses (least loaded after placing, fewest actors,
//! name), and how many alive nodes could ever hold it. Placing an actor reads the first
//! entry instead of scanning every node; a change to one node refreshes that node's entry
//! in each shape. Pure bookkeeping: the scheduler calls [`ShapeIndex::refresh`] after every
//! change to a node's ledger, actor count or liveness.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::placement::Ledger;
use crate::resources::Resources;

/// Shapes kept at once; the least recently used goes first (rebuilding one costs a scan
/// of the nodes).
pub const MAX_SHAPES: usize = 64;

/// What a free actor asks for, as the index keys it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Shape {
    /// The actor kind (only nodes registering it can host it).
    pub kind: String,
    /// The resources asked for.
    pub request: Resources,
}

/// One node as the index sees it.
#[derive(Clone, Copy, Debug)]
pub struct NodeState<'a> {
    /// The node's name.
    pub name: &'a str,
    /// Kinds it registers.
    pub kinds: &'a [String],
    /// Its ledger.
    pub ledger: &'a Ledger,
    /// Actors it hosts.
    pub actors: usize,
    /// Whether it is alive (a dead node holds nothing).
    pub alive: bool,
}

/// What the index says about a shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The best node that fits now.
    Fits(String),
    /// No node fits now, but some alive node could when emptier.
    Busy,
    /// No alive node could ever hold it.
    Never,
}

/// Order of nodes for a shape: load after placing, actors, name (smallest first).
type Rank = (u64, usize, String);

/// One node's standing for one shape.
struct Standing {
    /// Whether the node could hold the shape with nothing else on it.
    ever: bool,
    /// Its key among the nodes the shape fits on now.
    rank: Option<Rank>,
}

struct ShapeNodes {
    fitting: BTreeSet<Rank>,
    nodes: HashMap<String, Standing>,
    ever: usize,
    last_used: u64,
}

impl ShapeNodes {
    fn new() -> Self {
        Self {
            fitting: BTreeSet::new(),
            nodes: HashMap::new(),
            ever: 0,
            last_used: 0,
        }
    }

    fn refresh(&mut self, shape: &Shape, node: NodeState<'_>) {
        if let Some(old) = self.nodes.remove(node.name) {
            if let Some(rank) = old.rank {
                self.fitting.remove(&rank);
            }
            if !node.alive {
                self.ever -= usize::from(old.ever);
                return;
            }
            self.insert(shape, node, old.ever);
        } else if node.alive {
            let ever = node.kinds.contains(&shape.kind) && node.ledger.could_fit(&shape.request);
            self.ever += usize::from(ever);
            self.insert(shape, node, ever);
        }
    }

    fn insert(&mut self, shape: &Shape, node: NodeState<'_>, ever: bool) {
        let rank = (ever && node.ledger.fits_now(&shape.request)).then(|| {
            (
                node.ledger.load_after(&shape.request),
                node.actors,
                node.name.to_string(),
            )
        });
        if let Some(rank) = &rank {
            self.fitting.insert(rank.clone());
        }
        self.nodes.insert(node.name.to_string(), Standing { ever, rank });
    }

    fn lookup(&self) -> Lookup {
        match self.fitting.first() {
            Some((_, _, node)) => Lookup::Fits(node.clone()),
            None if self.ever > 0 => Lookup::Busy,
            None => Lookup::Never,
        }
    }
}

/// The index over every shape placed recently.
#[derive(Default)]
pub struct ShapeIndex {
    shapes: BTreeMap<Shape, ShapeNodes>,
    clock: u64,
}

impl ShapeIndex {
    /// Refreshes one node's entry in every shape, after its ledger, actor count or
    /// liveness changed (a dead node leaves every shape).
    pub fn refresh(&mut self, node: NodeState<'_>) {
        for (shape, nodes) in &mut self.shapes {
            nodes.refresh(shape, node);
        }
    }

    /// Where `shape` goes now. A shape not indexed yet is built from `nodes` (every node
    /// the scheduler knows) first.
    pub fn lookup<'a, I>(&mut self, shape: &Shape, nodes: impl FnOnce() -> I) -> Lookup
    where
        I: IntoIterator<Item = NodeState<'a>>,
    {
        self.clock += 1;
        if !self.shapes.contains_key(shape) {
            if self.shapes.len() >= MAX_SHAPES {
                let oldest = self
                    .shapes
                    .iter()
                    .min_by_key(|(_, n)| n.last_used)
                    .map(|(s, _)| s.clone());
                if let Some(oldest) = oldest {
                    self.shapes.remove(&oldest);
                }
            }
            let mut built = ShapeNodes::new();
            for node in nodes() {
                built.refresh(shape, node);
            }
            self.shapes.insert(shape.clone(), built);
        }
        let Some(entry) = self.shapes.get_mut(shape) else {
            return Lookup::Never;
        };
        entry.last_used = self.clock;
        entry.lookup()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{place_actor, Candidate, Decision};

    struct Node {
        name: String,
        kinds: Vec<String>,
        ledger: Ledger,
        actors: usize,
        alive: bool,
    }

    impl Node {
        fn state(&self) -> NodeState<'_> {
            NodeState {
                name: &self.name,
                kinds: &self.kinds,
                ledger: &self.ledger,
                actors: self.actors,
                alive: self.alive,
            }
        }
    }

    /// A small deterministic generator (xorshift), so failures replay.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn random_request(rng: &mut Rng) -> Resources {
        let text = match rng.below(6) {
            0 => "CPU=1".to_string(),
            1 => format!("CPU={}", 1 + rng.below(4)),
            2 => "GPU=1".to_string(),
            3 => "GPU=0.5".to_string(),
            4 => format!("CPU=1,GPU={}", 1 + rng.below(2)),
            _ => "memory=1000".to_string(),
        };
        Resources::parse_request(&text).unwrap()
    }

    fn random_node(rng: &mut Rng, name: String) -> Node {
        let capacity = format!(
            "CPU={},GPU={},memory={}",
            1 + rng.below(8),
            rng.below(4),
            1000 * (1 + rng.below(4))
        );
        let kinds = if rng.below(4) == 0 {
            vec!["other"]
        } else {
            vec!["echo", "other"]
        };
        Node {
            name,
            kinds: kinds.into_iter().map(String::from).collect(),
            ledger: Ledger::for_node(Resources::parse_capacity(&capacity).unwrap()),
            actors: 0,
            alive: true,
        }
    }

    /// What the exhaustive placement decides for the same nodes.
    fn exhaustive(nodes: &[Node], shape: &Shape) -> Lookup {
        let candidates: Vec<Candidate<'_>> = nodes
            .iter()
            .filter(|n| n.alive && n.kinds.contains(&shape.kind))
            .map(|n| Candidate {
                node: &n.name,
                ledger: &n.ledger,
                actors: n.actors,
            })
            .collect();
        match place_actor(&candidates, &shape.request) {
            Decision::Place(node) => Lookup::Fits(node),
            Decision::Busy => Lookup::Busy,
            Decision::Infeasible(_) => Lookup::Never,
        }
    }

    /// Random clusters and random sequences of placements, releases, deaths and joins:
    /// the index decides exactly what the exhaustive placement decides, every time.
    #[test]
    fn the_index_decides_what_the_exhaustive_placement_decides() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut nodes: Vec<Node> = (0..1 + rng.below(12))
                .map(|i| random_node(&mut rng, format!("n{i:02}")))
                .collect();
            let mut index = ShapeIndex::default();
            let mut held: Vec<(usize, crate::placement::Allocation)> = Vec::new();
            for step in 0..400 {
                let kind = if rng.below(5) == 0 { "other" } else { "echo" };
                let shape = Shape {
                    kind: kind.into(),
                    request: random_request(&mut rng),
                };
                match rng.below(10) {
                    0..=5 => {
                        let decided = index.lookup(&shape, || nodes.iter().map(Node::state));
                        assert_eq!(decided, exhaustive(&nodes, &shape), "seed {seed} step {step} {shape:?}");
                        if let Lookup::Fits(name) = decided {
                            let i = nodes.iter().position(|n| n.name == name).unwrap();
                            let allocation = nodes[i].ledger.allocate(&shape.request).unwrap();
                            nodes[i].actors += 1;
                            held.push((i, allocation));
                            index.refresh(nodes[i].state());
                        }
                    }
                    6 | 7 if !held.is_empty() => {
                        let (i, allocation) = held.swap_remove(rng.below(held.len() as u64) as usize);
                        if nodes[i].alive {
                            nodes[i].ledger.release(&allocation);
                            nodes[i].actors -= 1;
                            index.refresh(nodes[i].state());
                        }
                    }
                    8 => {
                        let i = rng.below(nodes.len() as u64) as usize;
                        nodes[i].alive = false;
                        index.refresh(nodes[i].state());
                    }
                    _ => {
                        // A node joins, or a dead one comes back as a new, empty node.
                        let i = rng.below(nodes.len() as u64 + 1) as usize;
                        let name = format!("n{i:02}");
                        let fresh = random_node(&mut rng, name);
                        if i == nodes.len() {
                            nodes.push(fresh);
                        } else if !nodes[i].alive {
                            held.retain(|(h, _)| *h != i);
                            nodes[i] = fresh;
                        } else {
                            continue;
                        }
                        index.refresh(nodes[i].state());
                    }
                }
            }
        }
    }

    #[test]
    fn a_shape_no_alive_node_could_hold_is_never_and_a_full_one_is_busy() {
        let node = Node {
            name: "a".into(),
            kinds: vec!["echo".into()],
            ledger: Ledger::for_node(Resources::parse_capacity("CPU=1").unwrap()),
            actors: 0,
            alive: true,
        };
        let mut index = ShapeIndex::default();
        let two = Shape {
            kind: "echo".into(),
            request: Resources::parse_request("CPU=2").unwrap(),
        };
        assert_eq!(index.lookup(&two, || [node.state()]), Lookup::Never);
        let one = Shape {
            kind: "echo".into(),
            request: Resources::parse_request("CPU=1").unwrap(),
        };
        let mut full = node;
        full.ledger.allocate(&one.request).unwrap();
        assert_eq!(index.lookup(&one, || [full.state()]), Lookup::Busy);
    }

    #[test]
    fn the_least_recently_used_shape_is_dropped_past_the_limit() {
        let node = Node {
            name: "a".into(),
            kinds: vec!["echo".into()],
            ledger: Ledger::for_node(Resources::parse_capacity("memory=100000").unwrap()),
            actors: 0,
            alive: true,
        };
        let mut index = ShapeIndex::default();
        for amount in 1..=(MAX_SHAPES as u64 + 10) {
            let shape = Shape {
                kind: "echo".into(),
                request: Resources::parse_request(&format!("memory={amount}")).unwrap(),
            };
            assert_eq!(index.lookup(&shape, || [node.state()]), Lookup::Fits("a".into()));
        }
        assert_eq!(index.shapes.len(), MAX_SHAPES);
    }
}
