//! Where a cluster member made the regions of its copies, recorded in etcd
//! (`kv_cluster::etcd::Keys::regions_made`, with no lease: it outlives the
//! member's absences), so that a server of its name never serves an empty
//! region in place of one the member made before and that is not there
//! now: a server started with another `--listen` (a typo, another host)
//! or after a reboot emptied /dev/shm. Serving one would answer "not
//! found" for every key the copy held, and in a cluster of several copies
//! pass an empty copy off as a level one.
//!
//! A copy's region is made without a move only for the first map's deal;
//! every later copy comes by a move (whose target starts from nothing, see
//! `shard_host::prepare_region`) or is one the member already held. So a
//! member whose record existed before this process made any region has no
//! copy to make from nothing: a missing region is a lost one.

use std::path::Path;

use kv_cluster::etcd::BlockingEtcd;
use kv_cluster::ClusterUrl;

/// Why a copy may not start.
pub enum Refusal {
    /// Its region is lost: serving an empty one would lose its keys.
    Lost(String),
    /// etcd did not say whether the member made regions before.
    Unchecked(String),
}

pub struct RegionsMade {
    url: ClusterUrl,
    member: String,
    listen: String,
    /// `--recreate-missing-regions`: the operator accepts the loss.
    recreate_missing: bool,
    /// The record as this process first read it, before it wrote one.
    before: Option<Option<String>>,
    /// Whether the record names this server's `listen`.
    recorded: bool,
    etcd: Option<BlockingEtcd>,
}

impl RegionsMade {
    pub fn new(url: ClusterUrl, member: &str, listen: &str, recreate_missing: bool) -> Self {
        RegionsMade {
            url,
            member: member.to_string(),
            listen: listen.to_string(),
            recreate_missing,
            before: None,
            recorded: false,
            etcd: None,
        }
    }

    /// Before shard `shard`'s copy, one the map gave this member (not a
    /// move's), starts from its region at `path`: refused if the region
    /// is missing though the member made its regions before; else the
    /// member's regions are recorded as made at this server's address
    /// before any is made.
    pub fn vouch(&mut self, shard: u32, path: &Path) -> Result<(), Refusal> {
        let before = match &self.before {
            Some(before) => before.clone(),
            None => {
                let member = self.member.clone();
                let read = self.etcd()?.regions_made_at(&member);
                let before = read.map_err(|e| Refusal::Unchecked(e.to_string()))?;
                self.before = Some(before.clone());
                before
            }
        };
        if let (false, Some(at)) = (path.exists(), &before) {
            if !self.recreate_missing {
                return Err(Refusal::Lost(self.lost(shard, path, at)));
            }
            tracing::warn!(
                shard,
                "serving an empty region in place of the missing {} (--recreate-missing-regions): \
                 what this copy held is gone",
                path.display()
            );
        }
        if !self.recorded {
            if before.as_deref() != Some(self.listen.as_str()) {
                let (member, listen) = (self.member.clone(), self.listen.clone());
                let written = self.etcd()?.record_regions_made(&member, &listen);
                written.map_err(|e| Refusal::Unchecked(e.to_string()))?;
            }
            self.recorded = true;
        }
        Ok(())
    }

    fn lost(&self, shard: u32, path: &Path, at: &str) -> String {
        let whence = match at == self.listen {
            true => "here before (was /dev/shm emptied, by a reboot?)".to_string(),
            false => format!("at {at} before (this server listens at {})", self.listen),
        };
        format!(
            "shard {shard}'s region {} is missing, though member {} made its regions {whence}; \
             an empty one served in its place would lose every key the copy held. Start the \
             server where its regions are, or, if they are gone for good, with \
             --recreate-missing-regions to serve its copies empty",
            path.display(),
            self.member
        )
    }

    fn etcd(&mut self) -> Result<&mut BlockingEtcd, Refusal> {
        if self.etcd.is_none() {
            let etcd =
                BlockingEtcd::connect(&self.url).map_err(|e| Refusal::Unchecked(e.to_string()))?;
            self.etcd = Some(etcd);
        }
        self.etcd
            .as_mut()
            .ok_or_else(|| Refusal::Unchecked("no etcd connection".into()))
    }
}
