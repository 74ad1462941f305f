// Entries and their lifetimes: handles (id + salted check word), lookup for a load, load
// prediction (GPU; a layer stack's streamed loads also on the CPU, checked there), release at the
// counted last load, sweeps of uncounted entries, and freeing a released entry's host buffer and
// file slot once nothing uses them.
#include <algorithm>
#include <set>

#include "engine.h"

namespace ssdtrain {

std::string DescribeTag(std::string_view name, int64_t site, uint32_t id) {
  return "tag '" + std::string(name) + "' (site " + std::to_string(site) + ", id " +
         std::to_string(id) + ")";
}

uint32_t HandleCheckWithSalt(uint32_t id, uint32_t salt) {
  // A mixing hash of id and an engine's salt: a bit flipped in either word is detected.
  uint64_t z = (static_cast<uint64_t>(id) << 32 | salt) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

uint32_t Engine::HandleCheck(uint32_t id) const { return HandleCheckWithSalt(id, salt_); }

void Engine::MakeHandle(const Entry& e, uint32_t h[2]) const {
  h[0] = e.id_;
  h[1] = HandleCheck(e.id_);
}

Status Engine::LookupForLoad(Lock& lk, const uint32_t h[2], uint64_t nbytes, int64_t site,
                             std::string_view name, EntryPtr* out, int device, bool consume) {
  if (h[0] != 0 && HandleCheck(h[0]) != h[1] && FromReplacedStore(h))
    return Status(EINVAL, "stale ssdtrain handle {" + std::to_string(h[0]) + ", " +
                              std::to_string(h[1]) + "} for tag '" + std::string(name) +
                              "' (site " + std::to_string(site) +
                              "): its entry belongs to a store that was replaced since it was "
                              "stored (jax_ssdtrain.configure(...) and shutdown() drop every "
                              "stored tensor: activations, a streamed stack, offloaded optimizer "
                              "state). Make it again after configure() (init_streamed, "
                              "stack_from_tree, tx.init, ...), or configure the store before "
                              "making it");
  if (h[0] == 0)
    return Status(EINVAL, "invalid or stale ssdtrain handle {0, " + std::to_string(h[1]) +
                              "} for tag '" + std::string(name) + "' (site " +
                              std::to_string(site) +
                              "): the null handle, which a store counted to have no load "
                              "(uses=0) returns, keeping nothing (or zeros made by hand)");
  if (HandleCheck(h[0]) != h[1])
    return Status(EINVAL, "invalid or stale ssdtrain handle {" + std::to_string(h[0]) + ", " +
                              std::to_string(h[1]) + "} for tag '" + std::string(name) +
                              "' (site " + std::to_string(site) +
                              "): it comes from no store of this process "
                              "(corrupted, made by hand or by another process)");
  auto it = entries_.find(h[0]);
  if (it == entries_.end())
    return Status(EINVAL, "activation was already released: " + DescribeTag(name, site, h[0]) +
                              " (an entry is released after its last load in the execution that "
                              "stored it, or, when its handle left that execution, by a sweep "
                              "once no live jax.Array holds the handle; also by release_all() "
                              "and by reconfiguration; optimizer state updated in place "
                              "(offload_optimizer(in_place=True)) is released by the update that "
                              "read it: optax.MultiSteps around it keeps that state where it does "
                              "not apply the update, use jax_ssdtrain.accumulate_gradients)");
  EntryPtr e = it->second;
  if (e->site_ != site)
    return Status(EINVAL, "ssdtrain handle of " + DescribeTag(e->name_, e->site_, e->id_) +
                              " used by a load of tag '" + std::string(name) + "' at site " +
                              std::to_string(site));
  if (e->device_ != device)
    return Status(EINVAL, "ssdtrain handle of " + DescribeTag(e->name_, e->site_, e->id_) +
                              " stored by device " + std::to_string(e->device_) +
                              " used by a load on device " + std::to_string(device) +
                              " (a handle never leaves the device that stored it)");
  if (e->nbytes_ != nbytes)
    return Status(EINVAL, "load of " + DescribeTag(name, site, e->id_) + ": output has " +
                              std::to_string(nbytes) + " bytes but " + std::to_string(e->nbytes_) +
                              " bytes were stored");
  if (!e->error_.ok()) return e->error_.With("load of " + DescribeTag(name, site, e->id_));
  if (e->retired()) Revive(*e);
  // A consuming load is the last: CountLoad releases the entry (a manual one stays manual).
  if (consume && e->uses_left_ != Entry::kManual && e->uses_left_ != 0) e->uses_left_ = 1;
  if (e->loads_++ == 0) {
    unloaded_.erase(e->seq_);
    if (cfg_.forwarding && e->w_ == WState::kQueued) {
      e->w_ = WState::kCancelled;
      writes_inflight_--;
      stats_.write_skipped_bytes += e->nbytes_;
      stats_.write_skipped_tensors++;
      // Keep the slot: it is released with the entry.
      cv_.notify_all();
    }
  }
  stats_.bytes_read += nbytes;
  stats_.tensors_read++;
  DeviceStats& ds = device_stats_[device];
  ds.bytes_read += nbytes;
  ds.tensors_read++;
  *out = e;
  return Status::Ok();
}

bool Engine::PredictLoad(int64_t site, int64_t run_id, int device, uint64_t nbytes, uint32_t h[2],
                         uint64_t* left) const {
  auto ids = by_site_.find({device, site});
  if (ids == by_site_.end()) return false;
  const Entry* best = nullptr;
  for (uint32_t id : ids->second) {
    auto it = entries_.find(id);
    if (it == entries_.end()) continue;
    const Entry* e = it->second.get();
    if (e->loads_ || e->retired() || e->run_id_ != run_id || e->nbytes_ != nbytes) continue;
    if (!best || e->seq_ > best->seq_) best = e;
  }
  if (!best) return false;
  uint64_t n = 0;
  for (const auto& [seq, e] : unloaded_)
    if (e->run_id_ == run_id && e->device_ == device && e.get() != best) n++;
  *left = n;
  MakeHandle(*best, h);
  return true;
}

bool Engine::PredictOrderedLoad(int64_t site, int64_t run_id, int device, uint64_t nbytes,
                                uint32_t h[2], uint64_t* left) const {
  auto src = exact_sources_.find(device);
  if (src == exact_sources_.end() || src->second.run_id != run_id) return false;
  // Per site and size: the execution that stored its entries and the last loaded one's seq; one
  // not loaded yet in this execution: the first exact load's execution, from its oldest entry.
  const ExactSource& s = src->second;
  auto at = [&s](int64_t site_id, uint64_t size) -> ExactSource::Cursor {
    auto c = s.sites.find({site_id, size});
    return c == s.sites.end() ? ExactSource::Cursor{s.stored_by, 0} : c->second;
  };
  ExactSource::Cursor here = at(site, nbytes);
  auto ids = by_site_.find({device, site});
  if (ids == by_site_.end()) return false;
  if (!s.sites.count({site, nbytes}) &&
      !FirstOrderedSource(ids->second, s.stored_by, nbytes, &here.stored_by))
    return false;
  const Entry* next = nullptr;
  for (uint32_t id : ids->second) {
    auto it = entries_.find(id);
    if (it == entries_.end()) continue;
    const Entry* e = it->second.get();
    if (e->run_id_ != here.stored_by || e->seq_ <= here.seq || e->nbytes_ != nbytes || e->retired())
      continue;
    if (!next || e->seq_ < next->seq_) next = e;
  }
  if (!next) return false;
  uint64_t n = 0;
  for (const auto& [id, e] : entries_) {
    if (e->device_ != device) continue;
    const ExactSource::Cursor c = e->site_ == site && e->nbytes_ == nbytes
                                      ? ExactSource::Cursor{here.stored_by, next->seq_}
                                      : at(e->site_, e->nbytes_);
    if (e->run_id_ == c.stored_by && e->seq_ > c.seq) n++;
  }
  *left = n;
  MakeHandle(*next, h);
  return true;
}

bool Engine::FirstOrderedSource(const std::set<uint32_t>& ids, int64_t first, uint64_t nbytes,
                                int64_t* from) const {
  // The newest live entry of each execution with entries of this size at the site.
  std::map<int64_t, uint64_t> newest;
  uint64_t top = 0;
  for (uint32_t id : ids) {
    auto it = entries_.find(id);
    if (it == entries_.end()) continue;
    const Entry* e = it->second.get();
    if (e->nbytes_ != nbytes || e->retired()) continue;
    newest[e->run_id_] = std::max(newest[e->run_id_], e->seq_);
    top = std::max(top, e->seq_);
  }
  auto f = newest.find(first);
  if (f != newest.end() && f->second == top) {
    *from = first;  // the version the execution's first exact load came from is the site's newest
    return true;
  }
  if (f == newest.end() && newest.size() == 1) {
    *from = newest.begin()->first;  // a leaf no later execution rewrote (initial parameters)
    return true;
  }
  return false;  // a newer version than the first load's, or several others: read the handle
}

void Engine::NoteExactLoad(int64_t run_id, int device, const Entry& e) {
  // The execution's first exact load names where the sites not loaded yet are; each site keeps
  // the execution that stored its last loaded entry (a state leaf an update never rewrites,
  // such as madgrad's or cocob's initial parameters, comes from an older one than the rest)
  // and the entry's place in it: the site's next ordered load of that size was stored after it.
  ExactSource& src = exact_sources_[device];
  if (src.run_id != run_id) src = ExactSource{run_id, e.run_id_, {}};
  src.sites[{e.site_, e.nbytes_}] = {e.run_id_, e.seq_};
}

std::vector<const Entry*> Engine::StreamAhead(int device, int64_t site,
                                              const StreamCursor& c) const {
  std::vector<const Entry*> out;
  auto ids = by_site_.find({device, site});
  if (ids == by_site_.end() || c.dir == 0) return out;
  for (uint32_t id : ids->second) {
    auto it = entries_.find(id);
    if (it == entries_.end()) continue;
    const Entry* e = it->second.get();
    if (e->run_id_ != c.stored_by || e->pass_ != c.store_pass || e->nbytes_ != c.nbytes ||
        e->retired())
      continue;
    if (c.dir > 0 ? e->seq_ > c.seq : e->seq_ < c.seq) out.push_back(e);
  }
  return out;
}

bool Engine::StreamCursor::Nearer(const Entry* a, const Entry* b) const {
  return dir > 0 ? a->seq() < b->seq() : a->seq() > b->seq();
}

bool Engine::PredictStreamLoad(int64_t site, int64_t pass, int64_t run_id, int device,
                               uint64_t nbytes, uint32_t h[2], uint64_t* left) const {
  auto src = stream_sources_.find(device);
  if (src == stream_sources_.end() || src->second.run_id != run_id) return false;
  auto here = src->second.sites.find({site, pass});
  if (here == src->second.sites.end()) return false;
  const StreamCursor& c = here->second;
  if (c.dir == 0 || c.nbytes != nbytes) return false;
  std::vector<const Entry*> ahead = StreamAhead(device, site, c);
  if (ahead.empty()) return false;
  uint64_t n = ahead.size() - 1;
  for (const auto& [key, oc] : src->second.sites)
    if (key != here->first) n += StreamAhead(device, key.first, oc).size();
  *left = n;
  auto nearer = [&c](const Entry* a, const Entry* b) { return c.Nearer(a, b); };
  MakeHandle(**std::min_element(ahead.begin(), ahead.end(), nearer), h);
  return true;
}

void Engine::NoteStreamLoad(int64_t run_id, int device, int64_t pass, int pass_dir,
                            const Entry& e) {
  StreamSource& src = stream_sources_[device];
  if (src.run_id != run_id) src = StreamSource{run_id, {}};
  StreamCursor& c = src.sites[{e.site_, pass}];
  const bool same_source =
      c.stored_by == e.run_id_ && c.store_pass == e.pass_ && c.nbytes == e.nbytes_ && c.seq != 0;
  if (!same_source)  // the pass's first load of the site (or another execution's entry): the
    c.dir = pass_dir * e.pass_dir_;  // layer orders say the direction in store order, or not (0)
  else if (e.seq_ != c.seq)
    c.dir = e.seq_ > c.seq ? 1 : -1;
  c.stored_by = e.run_id_;
  c.store_pass = e.pass_;
  c.seq = e.seq_;
  c.nbytes = e.nbytes_;
}

void Engine::CountUnusedStore(uint64_t nbytes, int device) {
  Lock lk(mu_);
  stats_.unused_stores++;
  (void)nbytes;
  (void)device;
}

bool Engine::CountLoad(const EntryPtr& e, bool defer) {
  if (e->uses_left_ <= 0 || e->released()) return false;
  if (--e->uses_left_ > 0) return false;
  stats_.counted_releases++;
  if (defer) return true;
  Release(e);
  return false;
}

Status Engine::Sweep(const uint32_t* pairs, uint64_t n_pairs, uint64_t seq_limit,
                     uint64_t* released, bool retire) {
  std::set<uint64_t> live;
  for (uint64_t i = 0; i < n_pairs; ++i)
    live.insert(static_cast<uint64_t>(pairs[2 * i]) << 32 | pairs[2 * i + 1]);
  Lock lk(mu_);
  if (hooks_) hooks_->ReclaimReleases(true);
  std::vector<EntryPtr> dead;
  uint64_t survivors = 0, survivor_bytes = 0;
  for (auto& [id, e] : entries_) {
    const uint64_t key = static_cast<uint64_t>(id) << 32 | HandleCheck(id);
    if (e->uses_left_ == Entry::kManual) continue;
    if (e->seq_ >= seq_limit || e->loading_ > 0 || e->filling() || live.count(key)) {
      if (e->retired() && live.count(key)) Revive(*e);
      if (e->uses_left_ == Entry::kUncounted && !e->retired()) {
        survivors++;
        survivor_bytes += e->nbytes_;
      }
      continue;
    }
    if (!(retire && e->retired())) dead.push_back(e);
  }
  for (auto& e : dead) retire ? Retire(e) : Release(e);
  stats_.sweeps++;
  stats_.swept_entries += dead.size();
  *released = dead.size();
  // The next sweep is due when the uncounted entries made since have doubled what survived
  // (at least 64 entries, or an eighth of the host tier / file space in bytes).
  uncounted_since_sweep_ = uncounted_bytes_since_sweep_ = 0;
  sweep_mark_entries_ = std::max<uint64_t>(64, survivors);
  const uint64_t room =
      std::min<uint64_t>(std::max<uint64_t>(cfg_.host_tier_bytes, kGiB), cfg_.capacity_bytes);
  sweep_mark_bytes_ = std::max<uint64_t>(room / 8, survivor_bytes);
  return Status::Ok();
}

bool Engine::SweepRequested() {
  Lock lk(mu_);
  if (sweep_mark_bytes_ == 0) {
    const uint64_t room =
        std::min<uint64_t>(std::max<uint64_t>(cfg_.host_tier_bytes, kGiB), cfg_.capacity_bytes);
    sweep_mark_bytes_ = room / 8;
  }
  return uncounted_since_sweep_ >= sweep_mark_entries_ ||
         (uncounted_since_sweep_ > 0 && uncounted_bytes_since_sweep_ >= sweep_mark_bytes_);
}

void Engine::Retire(const EntryPtr& e) {
  e->life_ = EntryLife::kRetired;  // from kLive: a sweep retires no entry still filling
  retired_[e->seq_] = e;
  retired_bytes_ += e->nbytes_;
  unloaded_.erase(e->seq_);  // no read-ahead of it (a load that comes reads on demand)
}

void Engine::Revive(Entry& e) {
  e.life_ = EntryLife::kLive;
  retired_.erase(e.seq_);
  retired_bytes_ -= e.nbytes_;
  stats_.revived_entries++;
  if (e.loads_ == 0) unloaded_[e.seq_] = entries_.at(e.id_);
}

bool Engine::ReleaseOldestRetired() {
  if (retired_.empty()) return false;
  EntryPtr e = retired_.begin()->second;
  stats_.retired_reclaimed++;
  Release(e);
  return true;
}

void Engine::Release(const EntryPtr& e) {
  if (e->released()) return;
  if (e->retired()) {
    retired_.erase(e->seq_);
    retired_bytes_ -= e->nbytes_;
  }
  e->life_ = e->filling() ? EntryLife::kReleasedFilling : EntryLife::kReleased;
  entries_.erase(e->id_);
  auto s = by_site_.find({e->device_, e->site_});
  if (s != by_site_.end()) {
    s->second.erase(e->id_);
    if (s->second.empty()) by_site_.erase(s);
  }
  unloaded_.erase(e->seq_);
  if (e->w_ == WState::kQueued) {
    e->w_ = WState::kCancelled;
    writes_inflight_--;
    stats_.write_skipped_bytes += e->nbytes_;
    stats_.write_skipped_tensors++;
  }
  pending_free_++;
  MaybeFree(e);
}

void Engine::MaybeFree(const EntryPtr& e) {
  if (e->life_ != EntryLife::kReleased || e->pins_ > 0 || e->reading() || e->w_ == WState::kRunning)
    return;
  FreeHostBuffer(*e);
  if (e->has_slot_) {
    space_.Free(e->file_off_, e->padded_);
    e->has_slot_ = false;
  }
  if (hooks_ && e->dev_) hooks_->OnEntryFree(*e);
  e->life_ = EntryLife::kFreed;
  pending_free_--;
  frees_++;
  cv_.notify_all();
}

bool Engine::WaitForReleasedRoom(Lock& lk) {
  const auto io_in_flight = [&] { return writes_inflight_ > 0 || reads_inflight_ > 0; };
  if (pending_free_ == 0 || !io_in_flight()) return false;  // nothing I/O would free
  const uint64_t before = frees_;
  const auto t0 = Clock::now();
  cv_.wait(lk, [&] { return frees_ != before || !io_in_flight(); });
  stats_.stall_seconds += Seconds(t0, Clock::now());
  return frees_ != before;
}

Status Engine::ReleaseAll() {
  Lock lk(mu_);
  if (hooks_) hooks_->ReclaimReleases(true);
  std::vector<EntryPtr> all;
  all.reserve(entries_.size());
  for (auto& [id, e] : entries_) all.push_back(e);
  for (auto& e : all) Release(e);
  cv_.wait(lk, [&] { return pending_free_ == 0 && reads_inflight_ == 0 && writes_inflight_ == 0; });
  return Status::Ok();
}

}  // namespace ssdtrain
