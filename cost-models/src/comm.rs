//! Collective and point-to-point communication time over the tiers a group spans.
//!
//! Times follow the latency–bandwidth model of nccl-tests: a collective of `S` bytes over `n`
//! ranks moves `f(n) · S` bytes through each rank's slowest link, where `f` is 2(n−1)/n for an
//! all-reduce and (n−1)/n for all-gather / reduce-scatter, at the achieved *bus bandwidth* of the
//! tier (line rate × the profile's measured efficiency), plus a latency term per algorithm step.
//! A group that stays inside a node uses NVLink / NVSwitch / PCIe (and NVLink SHARP for
//! all-reduce where the node has it); a group that spans nodes is limited by the share of the
//! node's NICs it gets: every group on the node communicates at once in data/pipeline
//! parallelism, so `k` members per node get `k / gpus_per_node` of the node's NIC bandwidth.
//! Groups wider than a leaf switch (or rail group) meet the fabric's oversubscription: rings
//! only through the one edge per leaf they leave by, all-to-alls through every byte bound
//! beyond the leaf (`NetworkSpec::ring_slowdown`, `all_to_all_slowdown`).

use parallax_hardware::{ClusterProfile, FabricKind};
use parallax_ir::{Bytes, BytesPerSec, Seconds};
use serde::{Deserialize, Serialize};

/// Slowdown of compute while a collective runs beside it, as a fraction of the overlapped time:
/// NCCL kernels occupy streaming multiprocessors and memory bandwidth that the GEMMs they hide
/// behind would otherwise use (overlapped GEMMs run 10–30 % slower in the measurements of
/// Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in
/// Large Deep Learning Models", ASPLOS; and Jangda et al. 2022, CoCoNet). A physical constant of
/// the GPU/NCCL pair, not fitted per case.
pub const OVERLAP_INTERFERENCE: f64 = 0.2;

/// Time a collective of duration `comm` adds to a stream when it runs beside `compute` seconds
/// of work it can hide behind: the part that does not fit, plus the interference on the part
/// that does.
pub fn exposed(comm: Seconds, compute: Seconds) -> Seconds {
    let hidden = Seconds(comm.0.min(compute.0).max(0.0));
    Seconds((comm.0 - compute.0).max(0.0)) + interference(hidden)
}

/// What `hidden` seconds of communication beside compute cost that compute
/// ([`OVERLAP_INTERFERENCE`]).
pub fn interference(hidden: Seconds) -> Seconds {
    hidden * OVERLAP_INTERFERENCE
}

/// Kind of collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
}

/// Latency of an all-to-all over `g`: one exchange step per peer, at most eight outstanding
/// before they overlap.
fn all_to_all_latency(step: Seconds, g: Group) -> Seconds {
    step * (f64::from(g.size) - 1.0).min(8.0)
}

/// Where a group's members sit: `size` ranks, `per_node` of them in each node they touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    pub size: u32,
    pub per_node: u32,
}

impl Group {
    /// A group of `size` ranks whose consecutive members are `stride` global ranks apart, on
    /// nodes of `gpus_per_node` (Megatron orders ranks tp, cp, dp, pp from fastest to slowest,
    /// so the TP group has stride 1, the DP group stride tp × cp, and so on).
    pub fn strided(size: u32, stride: u32, gpus_per_node: u32) -> Group {
        let size = size.max(1);
        let per_node = if stride >= gpus_per_node {
            1
        } else {
            (gpus_per_node / stride.max(1)).clamp(1, size)
        };
        Group { size, per_node }
    }

    /// Nodes the group spans.
    pub fn nodes(&self) -> u32 {
        self.size.div_ceil(self.per_node.max(1))
    }
}

/// Communication cost model of one cluster profile.
#[derive(Clone, Copy, Debug)]
pub struct Network<'a> {
    profile: &'a ClusterProfile,
}

impl<'a> Network<'a> {
    pub fn new(profile: &'a ClusterProfile) -> Self {
        Network { profile }
    }

    fn gpus_per_node(&self) -> f64 {
        f64::from(self.profile.node.gpus_per_node.max(1))
    }

    /// Achieved bus bandwidth of a ring over `g`, and the latency of one algorithm step.
    fn ring_tier(&self, g: Group) -> (BytesPerSec, Seconds) {
        let intra = self.profile.intra_busbw();
        let intra_lat = self.profile.node.intra_latency();
        if g.nodes() <= 1 {
            return (intra, intra_lat);
        }
        let net = match &self.profile.network {
            Some(n) => n,
            // Validation forbids multi-node clusters without a network; stay finite anyway.
            None => return (intra, intra_lat),
        };
        let node_bw = self
            .profile
            .inter_busbw_per_node()
            .unwrap_or_else(|| net.node_bandwidth());
        let share = node_bw
            * (f64::from(g.per_node) / self.gpus_per_node())
            * (1.0 / net.ring_slowdown(g.nodes()));
        let bw = if g.per_node > 1 {
            BytesPerSec(share.0.min(intra.0))
        } else {
            share
        };
        (bw, net.latency())
    }

    /// Latency of `passes` passes of a ring over `g`, as NCCL's tuning model counts it
    /// (`src/graph/tuning.cc`): each pass takes n−1 steps, of which N−1 cross nodes (at the
    /// network's per-message latency) and the rest stay inside one (at the intra-node link's).
    /// All-gather, reduce-scatter and broadcast have only ring algorithms in NCCL before 2.23's
    /// PAT (which serves one rank per node), so at thousands of ranks a single call costs
    /// milliseconds however small its buffer.
    fn ring_latency(&self, g: Group, passes: f64) -> Seconds {
        let (intra, inter) = self.step_latencies(g);
        let inter_steps = f64::from(g.nodes() - 1);
        let intra_steps = (f64::from(g.size) - 1.0 - inter_steps).max(0.0);
        (intra * intra_steps + inter * inter_steps) * passes
    }

    /// Latency of one algorithm step of `g` inside a node, and across nodes (the intra-node
    /// one where `g` stays in a node).
    fn step_latencies(&self, g: Group) -> (Seconds, Seconds) {
        let intra = self.profile.node.intra_latency();
        match &self.profile.network {
            Some(net) if g.nodes() > 1 => (intra, net.latency()),
            _ => (intra, intra),
        }
    }

    /// Latency of an all-reduce: the ring's two passes, or NCCL's double binary tree where
    /// that is shorter (a chain of the k ranks inside each node, a tree of depth log2(N) over
    /// the nodes, up and down).
    fn all_reduce_latency(&self, g: Group) -> Seconds {
        let ring = self.ring_latency(g, 2.0);
        let (intra, inter) = self.step_latencies(g);
        let k = f64::from(g.per_node.min(g.size).max(1));
        let tree = (intra * (k - 1.0) + inter * f64::from(g.nodes()).log2().ceil()) * 2.0;
        if tree.0 < ring.0 {
            tree
        } else {
            ring
        }
    }

    /// Time of a collective over `g` of a buffer of `bytes` (the full, unsharded buffer for
    /// all-gather / reduce-scatter; each rank's whole send buffer for all-to-all).
    pub fn collective(&self, c: Collective, bytes: Bytes, g: Group) -> Seconds {
        let n = g.size;
        if n <= 1 || bytes.0 == 0 {
            return Seconds(0.0);
        }
        let nf = f64::from(n);
        let (bw, step) = self.ring_tier(g);
        let s = bytes.0 as f64;
        match c {
            Collective::AllReduce => {
                let ring = Seconds(2.0 * (nf - 1.0) / nf * s / bw.0) + self.all_reduce_latency(g);
                match self.nvls(g) {
                    Some(algbw) => {
                        let t = Seconds(s / algbw.0) + step * 2.0;
                        if t.0 < ring.0 {
                            t
                        } else {
                            ring
                        }
                    }
                    None => ring,
                }
            }
            Collective::AllGather | Collective::ReduceScatter => {
                Seconds((nf - 1.0) / nf * s / bw.0) + self.ring_latency(g, 1.0)
            }
            Collective::Broadcast => Seconds(s / bw.0) + self.ring_latency(g, 1.0),
            Collective::AllToAll => {
                // Each rank keeps 1/n, sends (k−1)/n inside its node and (n−k)/n across nodes.
                let k = f64::from(g.per_node.min(n));
                let intra = self.profile.intra_busbw();
                let t_intra = (k - 1.0) / nf * s / intra.0;
                let t_inter = if g.nodes() > 1 {
                    let per_gpu = self.nic_share_per_gpu();
                    let spine = self
                        .profile
                        .network
                        .as_ref()
                        .map_or(1.0, |net| net.all_to_all_slowdown(g.nodes()));
                    (nf - k) / nf * s / per_gpu * spine
                } else {
                    0.0
                };
                Seconds(t_intra.max(t_inter)) + all_to_all_latency(step, g)
            }
        }
    }

    /// One GPU's share of its node's network bandwidth (the intra-node bandwidth where the
    /// profile gives no network).
    fn nic_share_per_gpu(&self) -> f64 {
        self.profile
            .inter_busbw_per_node()
            .map(|b| b.0 / self.gpus_per_node())
            .unwrap_or(self.profile.intra_busbw().0)
    }

    /// A node-deduplicated MoE dispatch (DeepEP's internode kernels, Megatron-Core's `flex`
    /// dispatcher) over group `g`: of a rank's `bytes` of routed copies (`top_k` per token),
    /// each token crosses the network once per remote node among its experts' nodes — with
    /// experts routed uniformly over `N` nodes, `N · (1 − (1 − 1/N)^k)` distinct nodes, of
    /// which `(N − 1) / N` remote — and fans out to its experts over NVLink (every copy once);
    /// the two overlap. Within one node it is the plain all-to-all.
    /// `node_cap` bounds the nodes a token's experts sit on (group-limited routing): its
    /// copies then spread over that many.
    pub fn deduplicated_dispatch(
        &self,
        bytes: Bytes,
        top_k: u64,
        g: Group,
        node_cap: Option<u32>,
    ) -> Seconds {
        let nodes = f64::from(g.nodes());
        if nodes <= 1.0 || top_k == 0 {
            return self.collective(Collective::AllToAll, bytes, g);
        }
        let k = top_k as f64;
        let reach = node_cap.map_or(nodes, |c| f64::from(c.max(1)).min(nodes));
        let distinct = reach * (1.0 - (1.0 - 1.0 / reach).powf(k));
        let remote = distinct * (nodes - 1.0) / nodes;
        let per_token = bytes.0 as f64 / k;
        let t_inter = per_token * remote / self.nic_share_per_gpu();
        let t_intra = bytes.0 as f64 / self.profile.intra_busbw().0;
        let (_, step) = self.ring_tier(g);
        Seconds(t_inter.max(t_intra)) + all_to_all_latency(step, g)
    }

    /// NVLink SHARP all-reduce algorithm bandwidth for an intra-node group, where available.
    fn nvls(&self, g: Group) -> Option<BytesPerSec> {
        if g.nodes() > 1 || g.size < 2 || self.profile.node.intra_fabric != FabricKind::Nvswitch {
            return None;
        }
        let eff = self.profile.collectives.nvls_allreduce_algbw_efficiency?;
        if !self.profile.node.nvls {
            return None;
        }
        Some(self.profile.node.intra_bandwidth() * eff)
    }

    /// Time to send `bytes` from one rank to a neighbour, inside a node or across nodes.
    pub fn p2p(&self, bytes: Bytes, cross_node: bool) -> Seconds {
        if bytes.0 == 0 {
            return Seconds(0.0);
        }
        let s = bytes.0 as f64;
        if cross_node {
            if let (Some(net), Some(bw)) =
                (&self.profile.network, self.profile.inter_busbw_per_nic())
            {
                return Seconds(s / bw.0) + net.latency();
            }
        }
        Seconds(s / self.profile.intra_busbw().0) + self.profile.node.intra_latency()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_hardware::{preset, ClusterProfile};

    fn busbw_allreduce(net: &Network, bytes: f64, g: Group) -> f64 {
        let t = net
            .collective(Collective::AllReduce, Bytes(bytes as u64), g)
            .0;
        let n = f64::from(g.size);
        bytes / t * 2.0 * (n - 1.0) / n / 1e9
    }

    #[test]
    fn reproduces_the_reference_nccl_bandwidths() {
        // shared/ground-truth/hardware-reference.json
        let a100 = preset("dgx-a100-80gb").unwrap();
        let net = Network::new(&a100);
        let b = busbw_allreduce(&net, 8e9, Group::strided(8, 1, 8));
        assert!((b - 230.0).abs() < 10.0, "A100 intra {b}");
        // One DP group per GPU rank across 2 nodes: each gets one HDR NIC (~24 GB/s).
        let b = busbw_allreduce(&net, 8e9, Group::strided(2, 8, 8));
        assert!((b - 24.0).abs() < 2.0, "A100 per-NIC {b}");
        let h100 = preset("dgx-h100-80gb").unwrap();
        let net = Network::new(&h100);
        let b = busbw_allreduce(&net, 8e9, Group::strided(8, 1, 8));
        assert!((b - 480.0).abs() < 15.0, "H100 NVLS {b}");
        let ag = net
            .collective(
                Collective::AllGather,
                Bytes(8_000_000_000),
                Group::strided(8, 1, 8),
            )
            .0;
        let busbw = 8e9 / ag * 7.0 / 8.0 / 1e9;
        assert!((busbw - 370.0).abs() < 10.0, "H100 ring {busbw}");
    }

    #[test]
    fn ring_only_collectives_pay_a_step_per_rank_at_scale() {
        // NCCL has only rings for all-gather: at 2,048 ranks over 256 nodes a tiny buffer
        // still takes 1,792 NVLink steps and 255 network steps; an all-reduce takes the tree.
        let p = preset("dgx-a100-80gb").unwrap();
        let net = Network::new(&p);
        let g = Group::strided(2048, 1, 8);
        let tiny = Bytes(1024);
        let ag = net.collective(Collective::AllGather, tiny, g).0;
        let want =
            1792.0 * p.node.intra_latency().0 + 255.0 * p.network.as_ref().unwrap().latency().0;
        assert!((ag - want).abs() < 0.01 * want, "{ag} vs {want}");
        let ar = net.collective(Collective::AllReduce, tiny, g).0;
        assert!(
            ar < 0.05 * ag,
            "tree all-reduce {ar} vs ring all-gather {ag}"
        );
        // Inside one node the ring's steps are NVLink steps only.
        let small = net
            .collective(Collective::AllGather, tiny, Group::strided(8, 1, 8))
            .0;
        assert!(
            (small - 7.0 * p.node.intra_latency().0).abs() < 1e-7,
            "{small}"
        );
    }

    #[test]
    fn placement_matters() {
        let p = preset("dgx-a100-80gb").unwrap();
        let net = Network::new(&p);
        let bytes = Bytes(1 << 30);
        let inside = net.collective(Collective::AllReduce, bytes, Group::strided(8, 1, 8));
        let across = net.collective(Collective::AllReduce, bytes, Group::strided(8, 8, 8));
        assert!(across.0 > 5.0 * inside.0, "{across:?} vs {inside:?}");
        assert_eq!(
            net.collective(Collective::AllReduce, bytes, Group::strided(1, 1, 8))
                .0,
            0.0
        );
        assert!(net.p2p(bytes, true).0 > net.p2p(bytes, false).0);
    }

    #[test]
    fn oversubscription_slows_groups_wider_than_a_leaf() {
        let full = preset("dgx-h100-80gb").unwrap();
        let with = |r: f64, leaf: Option<u32>| {
            let mut p = full.clone();
            let net = p.network.as_mut().unwrap();
            net.oversubscription = r;
            net.nodes_per_leaf = leaf;
            p
        };
        let bytes = Bytes(1 << 30);
        let t =
            |p: &ClusterProfile, c: Collective, g: Group| Network::new(p).collective(c, bytes, g).0;
        let dp64 = Group::strided(64, 8, 8);
        let ep16 = Group::strided(16, 4, 8); // 2 per node over 8 nodes
        let base_ring = t(&full, Collective::AllReduce, dp64);
        let base_a2a = t(&full, Collective::AllToAll, ep16);
        // 2:1 above leaves of 32 nodes: a ring leaves each leaf by one edge (uplinks suffice);
        // an all-to-all over 8 nodes stays inside a leaf.
        let sparse = with(2.0, Some(32));
        assert_eq!(t(&sparse, Collective::AllReduce, dp64), base_ring);
        assert_eq!(t(&sparse, Collective::AllToAll, ep16), base_a2a);
        // Leaves of 4 nodes: the all-to-all sends 4 of 7 peers' bytes through half-rate
        // uplinks (8/7 of the NIC time); rings are still fed (2 / 4 < 1).
        let small = with(2.0, Some(4));
        let a2a = t(&small, Collective::AllToAll, ep16);
        assert!(a2a > base_a2a * 1.1, "{a2a} vs {base_a2a}");
        assert_eq!(t(&small, Collective::AllReduce, dp64), base_ring);
        // Leaf scope unknown: every inter-node byte crosses the 4:1 tier.
        let unknown = with(4.0, None);
        let ring = t(&unknown, Collective::AllReduce, dp64);
        assert!(ring > base_ring * 3.0, "{ring} vs {base_ring}");
        // Inside a node nothing changes.
        let tp8 = Group::strided(8, 1, 8);
        assert_eq!(
            t(&unknown, Collective::AllReduce, tp8),
            t(&full, Collective::AllReduce, tp8)
        );
    }

    #[test]
    fn overlap_hides_with_interference() {
        assert_eq!(exposed(Seconds(1.0), Seconds(3.0)).0, OVERLAP_INTERFERENCE);
        assert_eq!(
            exposed(Seconds(3.0), Seconds(1.0)).0,
            2.0 + OVERLAP_INTERFERENCE
        );
        assert_eq!(exposed(Seconds(0.0), Seconds(1.0)).0, 0.0);
    }

    #[test]
    fn strided_groups() {
        assert_eq!(
            Group::strided(8, 1, 8),
            Group {
                size: 8,
                per_node: 8
            }
        );
        assert_eq!(Group::strided(32, 8, 8).nodes(), 32);
        assert_eq!(
            Group::strided(4, 2, 8),
            Group {
                size: 4,
                per_node: 4
            }
        );
        assert_eq!(Group::strided(16, 2, 8).nodes(), 4);
    }

    #[test]
    fn deduplicated_dispatch_crosses_the_network_once_per_remote_node() {
        // DeepSeek-V3's dispatch over 64 ranks of 8 DGX H100 nodes: 8 copies a token, of which
        // the plain all-to-all sends 7/8 across nodes; deduplicated, a token crosses once per
        // remote node among its experts' (8 · (1 − (7/8)^8) · 7/8 ≈ 4.6 on average).
        let p = preset("dgx-h100-80gb").unwrap();
        let net = Network::new(&p);
        let g = Group::strided(64, 1, 8);
        let bytes = Bytes(2048 * 8 * 7168 * 2);
        let plain = net.collective(Collective::AllToAll, bytes, g);
        let dedup = net.deduplicated_dispatch(bytes, 8, g, None);
        assert!(dedup.0 < 0.8 * plain.0, "{dedup:?} vs {plain:?}");
        let per_gpu = p.inter_busbw_per_node().unwrap().0 / 8.0;
        let remote = 8.0 * (1.0 - (7.0f64 / 8.0).powi(8)) * 7.0 / 8.0;
        let inter = bytes.0 as f64 / 8.0 * remote / per_gpu;
        assert!(
            dedup.0 >= inter && dedup.0 < inter * 1.05,
            "{dedup:?} vs {inter}"
        );
        // Routed to at most 4 of the 8 nodes (DeepSeek-V3's group limit), fewer copies cross.
        let limited = net.deduplicated_dispatch(bytes, 8, g, Some(4));
        let remote4 = 4.0 * (1.0 - (3.0f64 / 4.0).powi(8)) * 7.0 / 8.0;
        let inter4 = bytes.0 as f64 / 8.0 * remote4 / per_gpu;
        assert!(limited < dedup && limited.0 >= inter4 && limited.0 < inter4 * 1.05);
        // Inside one node it is the all-to-all.
        let node = Group::strided(8, 1, 8);
        assert_eq!(
            net.deduplicated_dispatch(bytes, 8, node, None),
            net.collective(Collective::AllToAll, bytes, node)
        );
    }
}
