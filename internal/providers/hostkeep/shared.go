package hostkeep

// Garbage collection of a blob store that the providers of several nodes
// share (Snapshots.Shared, an S3 bucket).
//
// A node cannot see the other nodes' sandboxes, so each publishes what
// its sandboxes build on, and every collection marks from what every node
// published. The layout of the shared records:
//
//	snapshots/PROVIDER/SNAP.json   a snapshot's record (its manifests), a tombstone once deleted (removed after the grace period)
//	bases/PROVIDER/HOME/SB.json    the manifests sandbox SB of state directory HOME builds on (Pins)
//	homes/HOME.json                who HOME is (host, directory), for an operator
//	collectors/PROVIDER.json       PROVIDER's nodes publish their bases (collectorsDir)
//	gc/lock/HOME-RAND.json         a collector's lease (gcLease)
//
// The mark is every manifest that a live snapshot record of any provider
// in the store names (SnapMeta.Roots: its own and those it uses, such as
// a microVM snapshot's read-only disks), then every published base of
// every home (in that order: see PinFork), then this home's sandboxes'
// bases as its meta.json files say (Sandboxes.Bases). The sweep
// (cas.GCWith with a grace period, on a blob.Ager) never deletes a blob
// stored after its walk began, nor one stored within the grace period
// before: the chunks of snapshots and forks in progress anywhere, which
// nothing published names yet. A writer never relies on an old blob that
// nothing marks: the store's Has reports only copies stored within
// ShareOptions.Reuse (blob.S3Options.ReuseWithin), shorter than the grace
// period, and a sandbox's bases, which it does rely on however old their
// copies (cas's incremental Snapshot and StageFile on a base, a microVM's
// stored disks), are published before they are used.
//
// Both host providers publish (local: a sandbox's last snapshot and its
// index; microvm: a sandbox's saved state and its read-only disks in the
// store), and say so in a record under collectors/; a collection refuses
// a store holding snapshots of any other provider (checkAllPublish).
//
// The publication protocol:
//   - a fork publishes the snapshot's manifests as the new sandbox's base
//     and only then checks that the snapshot is still live (PinFork): a
//     collector that found its record deleted lists the bases after that,
//     so it sees the pin;
//   - new bases are published beside the old ones before meta.json names
//     them, and alone after (Sandboxes.Rebase);
//   - a sandbox's pin is removed once it is retired (Sandboxes.Retire);
//   - Reconcile, when the provider opens and before each of its
//     collections, publishes what is missing and removes the pins of
//     sandboxes no longer there (a crash between the steps above).
//
// A node that died keeps its pins, and so its sandboxes' blobs, until its
// state directory is opened again (Reconcile removes what is gone), or an
// operator who knows the machine is gone forgets its home (ForgetHome).
// Nothing else removes them: a node whose lease lapsed in the record store
// may still be running sandboxes, cut off from the database only.
//
// Collections are serialised by a lease record (gcLease); the lease is
// for economy, not safety: two collections at once delete no live blob,
// since each marks and sweeps as above, and the blob store's deletes are
// safe against each other.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/storage/cas"
	"stasis/sandbox"
)

// Defaults of ShareOptions.
const (
	// DefaultShareReuse is how recent a blob's copy must be for a writer to
	// rely on it rather than store it again (blob.S3Options.ReuseWithin).
	DefaultShareReuse = 30 * time.Minute
	// DefaultShareGrace is how long a blob is kept, marked or not, after it
	// was stored: longer than DefaultShareReuse plus the longest snapshot
	// or fork, plus the skew between the nodes' estimates of the store's
	// clock.
	DefaultShareGrace = 2 * time.Hour
	// DefaultLeaseWait is how long an explicit collection waits for
	// another node's to finish.
	DefaultLeaseWait = 10 * time.Minute
	// DefaultCollectEvery is ShareOptions.CollectEvery's default.
	DefaultCollectEvery = 10 * time.Minute
)

// ShareOptions tune the collection of a shared blob store.
type ShareOptions struct {
	// Reuse must be the store's blob.S3Options.ReuseWithin (default
	// DefaultShareReuse), which Grace must exceed.
	Reuse time.Duration
	// Grace is the collections' grace period (default DefaultShareGrace).
	Grace time.Duration
	// LeaseWait bounds how long CollectBlobs waits while another node
	// collects (default DefaultLeaseWait); a snapshot's deletion does not
	// wait: it leaves the collection to the node collecting.
	LeaseWait time.Duration
	// CollectEvery spaces the collections that snapshots' deletions ask
	// for: a deletion within CollectEvery of this node's last collection
	// leaves its blobs to a later one (default DefaultCollectEvery;
	// negative: every deletion collects). A collection walks the whole
	// store, which holds every blob of the grace period, and frees only
	// blobs older than that: collecting at every checkpoint's deletion
	// would walk the store again and again for nothing. CollectBlobs
	// always collects.
	CollectEvery time.Duration
	// AfterMark, when set, runs in each collection between the mark and
	// the sweep (tests: a snapshot or a fork made meanwhile).
	AfterMark func()
}

// WithDefaults fills o's zero fields and checks them.
func (o ShareOptions) WithDefaults() (ShareOptions, error) {
	if o.Reuse == 0 {
		o.Reuse = DefaultShareReuse
	}
	if o.Grace == 0 {
		o.Grace = DefaultShareGrace
	}
	if o.LeaseWait == 0 {
		o.LeaseWait = DefaultLeaseWait
	}
	if o.CollectEvery == 0 {
		o.CollectEvery = DefaultCollectEvery
	}
	if o.Reuse < 0 || o.Grace <= o.Reuse || o.LeaseWait < 0 {
		return o, fmt.Errorf("shared blob store: a grace period of %s and reuse within %s: the grace period must be longer than the reuse window (plus the longest snapshot), both positive", o.Grace, o.Reuse)
	}
	return o, nil
}

// SharedRecords are documents kept in a store several nodes read
// (blob.S3's records), and that store's clock.
type SharedRecords interface {
	PutRecord(ctx context.Context, name string, data []byte) error
	GetRecord(ctx context.Context, name string) ([]byte, error) // fs.ErrNotExist when none
	ListRecords(ctx context.Context, dir string) ([]string, error)
	DeleteRecord(ctx context.Context, name string) error // none is nil
	// Now is the time by the store's clock (never later than it is).
	Now() time.Time
}

// Pins are the incremental bases of one state directory's sandboxes
// (one provider's), published in the shared store so that the collection
// of every node keeps them.
type Pins struct {
	Records  SharedRecords
	Provider string
	// Home is the state directory's id in the store (HomeID).
	Home string
}

// pin is a sandbox's record under bases/.
type pin struct {
	Manifests []string `json:"manifests"`
}

func (p *Pins) dir() string { return "bases/" + p.Provider + "/" + p.Home + "/" }

func (p *Pins) name(id string) string { return p.dir() + id + ".json" }

// Set publishes manifests (empty ones left out) as what sandbox id builds
// on, replacing what it published before.
func (p *Pins) Set(ctx context.Context, id string, manifests ...string) error {
	var ms []string
	for _, m := range manifests {
		if m != "" && !slices.Contains(ms, m) {
			ms = append(ms, m)
		}
	}
	if len(ms) == 0 {
		return p.Drop(ctx, id)
	}
	b, err := json.Marshal(pin{Manifests: ms})
	if err != nil {
		return err
	}
	if err := p.Records.PutRecord(ctx, p.name(id), b); err != nil {
		return fmt.Errorf("publish the base of sandbox %s: %w", id, err)
	}
	return nil
}

// Drop removes sandbox id's pin; none is nil.
func (p *Pins) Drop(ctx context.Context, id string) error {
	if err := p.Records.DeleteRecord(ctx, p.name(id)); err != nil {
		return fmt.Errorf("remove the published base of sandbox %s: %w", id, err)
	}
	return nil
}

// has reports whether sandbox id has a pin.
func (p *Pins) has(ctx context.Context, id string) (bool, error) {
	_, err := p.Records.GetRecord(ctx, p.name(id))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}

// ids lists the sandboxes of this home that have pins.
func (p *Pins) ids(ctx context.Context) ([]string, error) {
	names, err := p.Records.ListRecords(ctx, p.dir())
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range names {
		if id, ok := strings.CutSuffix(path.Base(n), ".json"); ok {
			out = append(out, id)
		}
	}
	return out, nil
}

// homeFile holds a state directory's id in shared stores.
const homeFile = "home-id"

// HomeID is state directory dir's id in shared blob stores, made (h- and
// 16 random hex digits) the first time it is asked for and kept in
// dir/home-id.
func HomeID(dir string) (string, error) {
	p := filepath.Join(dir, homeFile)
	for {
		b, err := os.ReadFile(p)
		if err == nil {
			id := strings.TrimSpace(string(b))
			if !ValidID(id, "h-") {
				return "", fmt.Errorf("%s: %q is not a home id (h- and 16 hex digits); remove the file to have a new one made, after `stasis sandbox gc --forget-home` of the old one elsewhere", p, id)
			}
			return id, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
		// Made aside and linked in: of two processes making one at once,
		// one link wins and both read it.
		tmp, err := os.CreateTemp(dir, ".home-id-*")
		if err != nil {
			return "", err
		}
		_, werr := tmp.WriteString(NewID("h-") + "\n")
		if cerr := tmp.Close(); werr == nil {
			werr = cerr
		}
		if werr == nil {
			if err := os.Link(tmp.Name(), p); err != nil && !errors.Is(err, fs.ErrExist) {
				werr = err
			}
		}
		_ = os.Remove(tmp.Name())
		if werr != nil {
			return "", werr
		}
	}
}

// homeRecord is homes/HOME.json.
type homeRecord struct {
	ID      string    `json:"id"`
	Host    string    `json:"host"`
	Dir     string    `json:"dir"`
	Updated time.Time `json:"updated"`
}

// ShareBlobs makes sandboxes s and snapshots x of one provider, on state
// directory home, keep their records and bases in the shared store r (whose
// blob store x.CAS is on), with o's collection: x.Shared is r, and both
// publish the sandboxes' bases as Pins. It records who this home is and
// publishes the bases of the sandboxes already there (Reconcile).
func ShareBlobs[M any, PM MetaOf[M], K any, S any, PS SnapOf[S]](ctx context.Context, s *Sandboxes[M, PM, K], x *Snapshots[S, PS], r SharedRecords, home string, o ShareOptions) error {
	o, err := o.WithDefaults()
	if err != nil {
		return err
	}
	id, err := HomeID(home)
	if err != nil {
		return fmt.Errorf("shared blob store: %w", err)
	}
	pins := &Pins{Records: r, Provider: x.Provider, Home: id}
	x.Shared, x.share, x.pins = r, o, pins
	s.Pins = pins
	x.reconcile = s.Reconcile
	host, _ := os.Hostname()
	b, err := json.Marshal(homeRecord{ID: id, Host: host, Dir: home, Updated: r.Now().UTC()})
	if err != nil {
		return err
	}
	if err := r.PutRecord(ctx, "homes/"+id+".json", b); err != nil {
		return fmt.Errorf("shared blob store: %w", err)
	}
	if err := r.PutRecord(ctx, collectorsDir+x.Provider+".json", []byte(`{"publishes_bases":true}`)); err != nil {
		return fmt.Errorf("shared blob store: %w", err)
	}
	return s.Reconcile(ctx)
}

// collectorsDir holds a record for each provider whose nodes publish
// their sandboxes' bases (ShareBlobs): a collection marks only what such
// providers' nodes say they use, so it runs only when every provider with
// snapshots in the store is one of them.
const collectorsDir = "collectors/"

// errNotAllPublish refuses a collection of a store holding snapshots of
// a provider whose nodes publish no bases: its sandboxes may build on
// blobs no record names.
func (x *Snapshots[S, PS]) checkAllPublish(ctx context.Context) error {
	snaps, err := x.Shared.ListRecords(ctx, "snapshots/")
	if err != nil {
		return err
	}
	known, err := x.Shared.ListRecords(ctx, collectorsDir)
	if err != nil {
		return err
	}
	publish := map[string]bool{}
	for _, n := range known {
		publish[strings.TrimSuffix(strings.TrimPrefix(n, collectorsDir), ".json")] = true
	}
	for _, n := range snaps {
		provider, _, ok := strings.Cut(strings.TrimPrefix(n, "snapshots/"), "/")
		if ok && !publish[provider] {
			return errdefs.Errorf(errdefs.ErrConflict, "the shared store holds snapshots of the %s provider, whose nodes publish no sandbox bases: a collection could free blobs its sandboxes build on, so none runs (keep that provider's snapshots under another --blobs prefix)", provider)
		}
	}
	return nil
}

// Reconcile brings this home's pins into line with its sandbox
// directories: it publishes the base of a sandbox that has none
// published, and removes the pins of sandboxes no longer here. Pins are
// listed before the directories, and a fork makes its directory before it
// pins, so a fork in progress keeps its pin.
func (s *Sandboxes[M, PM, K]) Reconcile(ctx context.Context) error {
	if s.Pins == nil {
		return nil
	}
	pinned, err := s.Pins.ids(ctx)
	if err != nil {
		return fmt.Errorf("reconcile the published bases: %w", err)
	}
	ents, err := os.ReadDir(s.Dir)
	if err != nil {
		return err
	}
	here := map[string]bool{}
	for _, e := range ents {
		if ValidID(e.Name(), s.Prefix) {
			here[e.Name()] = true
		} else if id, ok := RetiringID(e.Name(), s.Prefix); ok {
			here[id] = true // its Retire removes the pin
		}
	}
	for _, id := range pinned {
		if !here[id] {
			if err := s.Pins.Drop(ctx, id); err != nil {
				return err
			}
		}
	}
	for id := range here {
		if slices.Contains(pinned, id) {
			continue
		}
		if err := s.pinMissing(ctx, id); err != nil {
			return err
		}
	}
	return nil
}

// pinMissing publishes sandbox id's bases (Sandboxes.Bases) if it has
// some and no pin, under its lock (which Rebase holds while it changes
// both).
func (s *Sandboxes[M, PM, K]) pinMissing(ctx context.Context, id string) error {
	unlock, err := s.lock("reconcile", id)
	if err != nil {
		return nil // gone, or retiring
	}
	defer unlock()
	m, err := s.Read("reconcile", id)
	if err != nil {
		return nil
	}
	bases := s.Bases(m)
	if len(bases) == 0 {
		return nil
	}
	if has, err := s.Pins.has(ctx, id); err != nil || has {
		return err
	}
	return s.Pins.Set(ctx, id, bases...)
}

// Pin publishes manifests as what sandbox id builds on (Pins.Set), when
// the store is shared.
func (s *Sandboxes[M, PM, K]) Pin(ctx context.Context, id string, manifests ...string) error {
	if s.Pins == nil {
		return nil
	}
	return s.Pins.Set(ctx, id, manifests...)
}

// PinFork, when the store is shared, publishes snapshot snap's manifests
// (SnapMeta.Roots: its own and those it uses) as the base of sandbox id,
// which is being forked from it (its directory made), and then checks
// that the snapshot is still there: a collection that could miss the pin
// finds the snapshot live. A snapshot deleted meanwhile is
// errdefs.ErrNotFound, with the pin removed. Call it before reading the
// snapshot's blobs.
func (x *Snapshots[S, PS]) PinFork(ctx context.Context, id string, snap S) error {
	if x.pins == nil {
		return nil
	}
	m := PS(&snap).snap()
	if err := x.pins.Set(ctx, id, m.Roots()...); err != nil {
		return err
	}
	if _, err := x.Read("fork", m.ID); err != nil {
		_ = x.pins.Drop(ctx, id)
		return err
	}
	return nil
}

// errBusy is another node's collection under way.
type errBusy struct{ holder string }

func (e errBusy) Error() string { return "another collection holds the lease: " + e.holder }

// gcLease is a collector's lease record, gc/lock/HOME-RAND.json, renewed
// while it collects.
type gcLease struct {
	Home    string    `json:"home"`
	Host    string    `json:"host"`
	Expires time.Time `json:"expires"` // by the store's clock
}

const (
	leaseDir = "gc/lock/"
	leaseTTL = time.Minute
)

// takeLease takes the collectors' lease: it puts its own record, lists
// every record, and holds the lease if no other unexpired one is there;
// otherwise it removes its own and returns errBusy. Of two collectors
// trying at once, at least the later to put sees the other's record, so
// no two hold it together (both may give up). Expired records (a
// collector that died) are removed. release stops the renewal and
// removes the record.
func takeLease(ctx context.Context, r SharedRecords, home string) (release func(), err error) {
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	own := leaseDir + home + "-" + hex.EncodeToString(rnd[:]) + ".json"
	host, _ := os.Hostname()
	put := func() error {
		b, err := json.Marshal(gcLease{Home: home, Host: host, Expires: r.Now().Add(leaseTTL).UTC()})
		if err != nil {
			return err
		}
		return r.PutRecord(ctx, own, b)
	}
	if err := put(); err != nil {
		return nil, fmt.Errorf("take the collectors' lease: %w", err)
	}
	names, err := r.ListRecords(ctx, leaseDir)
	if err != nil {
		_ = r.DeleteRecord(context.WithoutCancel(ctx), own)
		return nil, fmt.Errorf("take the collectors' lease: %w", err)
	}
	for _, n := range names {
		if n == own {
			continue
		}
		b, err := r.GetRecord(ctx, n)
		if errors.Is(err, fs.ErrNotExist) {
			continue // released meanwhile
		}
		if err != nil {
			_ = r.DeleteRecord(context.WithoutCancel(ctx), own)
			return nil, fmt.Errorf("take the collectors' lease: %s: %w", n, err)
		}
		var l gcLease
		if err := json.Unmarshal(b, &l); err != nil || !l.Expires.After(r.Now()) {
			// Expired, or not a lease at all (it would never expire).
			slog.Info("shared blob store: removing a stale collector's lease", "lease", n, "home", l.Home, "host", l.Host, "expired", l.Expires, "err", err)
			_ = r.DeleteRecord(ctx, n)
			continue
		}
		_ = r.DeleteRecord(context.WithoutCancel(ctx), own)
		return nil, errBusy{fmt.Sprintf("home %s on %s, until %s", l.Home, l.Host, l.Expires.Format(time.RFC3339))}
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(leaseTTL / 3)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				if err := put(); err != nil {
					// Another collection may start once it lapses: that
					// costs work, not blobs.
					slog.Warn("shared blob store: renewing the collectors' lease failed", "lease", own, "err", err)
				}
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(stop)
			<-done
			if err := r.DeleteRecord(context.WithoutCancel(ctx), own); err != nil {
				slog.Warn("shared blob store: releasing the collectors' lease failed; it lapses by itself", "lease", own, "err", err)
			}
		})
	}, nil
}

// waitLease takes the lease, waiting up to wait while others hold it.
func waitLease(ctx context.Context, r SharedRecords, home string, wait time.Duration) (func(), error) {
	deadline := time.Now().Add(wait)
	for {
		release, err := takeLease(ctx, r, home)
		var busy errBusy
		if !errors.As(err, &busy) {
			return release, err
		}
		if !time.Now().Before(deadline) {
			return nil, sandbox.Errorf(errdefs.ErrConflict, "gc", "the shared blob store", "%v; still held after %s: try again later", busy, wait)
		}
		// A random pause: two collectors that saw each other both gave up,
		// and must not meet again at once.
		var b [1]byte
		_, _ = rand.Read(b[:])
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200*time.Millisecond + time.Duration(b[0])*8*time.Millisecond):
		}
	}
}

// collectShared collects the shared store: under the collectors' lease
// (waiting for it up to ShareOptions.LeaseWait when wait, otherwise
// leaving the collection to whoever holds it), it reconciles this home's
// pins, marks and sweeps (see the top of this file).
func (x *Snapshots[S, PS]) collectShared(ctx context.Context, wait bool) (int, int64, error) {
	start := time.Now()
	var release func()
	var err error
	if wait {
		release, err = waitLease(ctx, x.Shared, x.pins.Home, x.share.LeaseWait)
	} else {
		release, err = takeLease(ctx, x.Shared, x.pins.Home)
		if busy := (errBusy{}); errors.As(err, &busy) {
			slog.Info("shared blob store: another node is collecting; leaving this collection to it", "holder", busy.holder)
			return 0, 0, nil
		}
	}
	if err != nil {
		return 0, 0, err
	}
	defer release()
	if err := x.reconcile(ctx); err != nil {
		return 0, 0, fmt.Errorf("gc: %w; nothing was deleted", err)
	}
	if err := x.checkAllPublish(ctx); err != nil {
		if !wait {
			slog.Warn("shared blob store: not collecting", "err", err)
			return 0, 0, nil
		}
		return 0, 0, fmt.Errorf("gc: %w; nothing was deleted", err)
	}
	snaps, err := x.sharedRoots(ctx, "snapshots/", func(name string, b []byte) ([]string, error) {
		var m SnapMeta
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, err
		}
		if m.Deleted {
			at := m.DeletedAt
			if at.IsZero() {
				at = time.Now() // a tombstone that does not say when
			}
			x.tombstones.Store(name, at) // a tombstone stays one
			return nil, nil
		}
		return m.Roots(), nil
	})
	if err != nil {
		return 0, 0, fmt.Errorf("gc: the snapshot records: %w; nothing was deleted", err)
	}
	bases, err := x.sharedRoots(ctx, "bases/", func(_ string, b []byte) ([]string, error) {
		var p pin
		err := json.Unmarshal(b, &p)
		return p.Manifests, err
	})
	if err != nil {
		return 0, 0, fmt.Errorf("gc: the published bases: %w; nothing was deleted", err)
	}
	own, err := x.Bases()
	if err != nil {
		return 0, 0, fmt.Errorf("gc: %w; nothing was deleted", err)
	}
	live := append(snaps, own...)
	slices.Sort(live)
	live = slices.Compact(live)
	slices.Sort(bases)
	bases = slices.DeleteFunc(slices.Compact(bases), func(m string) bool {
		_, found := slices.BinarySearch(live, m)
		return found // most bases are snapshots' manifests too
	})
	if x.share.AfterMark != nil {
		x.share.AfterMark()
	}
	// A published base whose manifest is gone (a fork that lost its
	// snapshot to a collection, and a crash before it removed its pin)
	// protects nothing and must not stop every collection.
	n, bytes, err := x.CAS.GCWith(ctx, live, cas.GCOptions{Grace: x.share.Grace, Optional: bases})
	if err != nil {
		return 0, 0, err
	}
	x.dropTombstones(ctx)
	x.lastCollect.Store(start.UnixNano())
	slog.Info("shared blob store: collected", "snapshot_roots", len(snaps), "published_bases", len(bases), "roots", len(live)+len(bases), "freed_blobs", n, "freed_bytes", bytes, "grace", x.share.Grace, "seconds", time.Since(start).Seconds())
	return n, bytes, nil
}

// dropTombstones removes the snapshot tombstones this process has seen
// that are older than the grace period. A tombstone only says that its
// snapshot is gone, as no record says too (Read, Find and the mark treat
// both alike; ids are 64 random bits, never handed out twice); kept for
// ever, the tombstones would grow every collection's listing of the
// records by every snapshot ever deleted. The grace period leaves time
// for whatever read the record while it lived (a fork's check of its
// pin, a collection's mark) to be over. A removal that fails is tried
// again at the next collection.
func (x *Snapshots[S, PS]) dropTombstones(ctx context.Context) {
	cutoff := time.Now().Add(-x.share.Grace)
	n := 0
	x.tombstones.Range(func(k, v any) bool {
		name, at := k.(string), v.(time.Time)
		if !at.Before(cutoff) {
			return true
		}
		if err := x.Shared.DeleteRecord(ctx, name); err != nil {
			slog.Warn("shared blob store: a snapshot's tombstone could not be removed; the next collection tries again", "record", name, "err", err)
			return ctx.Err() == nil
		}
		x.tombstones.Delete(name)
		n++
		return true
	})
	if n > 0 {
		slog.Info("shared blob store: removed snapshot tombstones older than the grace period", "tombstones", n, "grace", x.share.Grace)
	}
}

// sharedRoots reads every record under dir (all providers', all homes')
// but the snapshot tombstones this process has seen, and returns the
// manifests roots finds in them. A record removed while it is read is
// left out; one that cannot be read or decoded is an error.
func (x *Snapshots[S, PS]) sharedRoots(ctx context.Context, dir string, roots func(name string, b []byte) ([]string, error)) ([]string, error) {
	names, err := x.Shared.ListRecords(ctx, dir)
	if err != nil {
		return nil, err
	}
	found := make([][]string, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16) // records read at once
	for i, n := range names {
		if _, dead := x.tombstones.Load(n); dead || !strings.HasSuffix(n, ".json") {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			b, err := x.Shared.GetRecord(ctx, n)
			if errors.Is(err, fs.ErrNotExist) {
				return
			}
			if err == nil {
				found[i], err = roots(n, b)
			}
			if err != nil {
				errs[i] = fmt.Errorf("%s: %w", n, err)
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err // the first; the others are likely the same
		}
	}
	var out []string
	for _, ms := range found {
		for _, m := range ms {
			if m != "" {
				out = append(out, m)
			}
		}
	}
	return out, nil
}

// ForgetHome removes every pin that state directory home published in
// the shared store, and its record: for an operator who knows that the
// machine of that directory is gone for good (its sandboxes with it), so
// that the blobs only they built on can be collected. This home cannot
// forget itself (its pins follow its sandboxes). It returns how many pins
// it removed.
func (x *Snapshots[S, PS]) ForgetHome(ctx context.Context, home string) (int, error) {
	what := "home " + home
	if x.pins == nil {
		return 0, sandbox.Errorf(errdefs.ErrInvalid, "forget-home", what, "the %s provider's blob store is not shared (--blobs)", x.Provider)
	}
	if !ValidID(home, "h-") {
		return 0, sandbox.Errorf(errdefs.ErrInvalid, "forget-home", what, "not a home id (h- and 16 hex digits; the store's homes/ records list them)")
	}
	if home == x.pins.Home {
		return 0, sandbox.Errorf(errdefs.ErrInvalid, "forget-home", what, "that is this state directory; delete its sandboxes instead")
	}
	if _, err := x.Shared.GetRecord(ctx, "homes/"+home+".json"); errors.Is(err, fs.ErrNotExist) {
		return 0, sandbox.Errorf(errdefs.ErrNotFound, "forget-home", what, "no such home in the shared store (forgotten already?)")
	} else if err != nil {
		return 0, err
	}
	names, err := x.Shared.ListRecords(ctx, "bases/")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, name := range names {
		if parts := strings.Split(name, "/"); len(parts) == 4 && parts[2] == home {
			if err := x.Shared.DeleteRecord(ctx, name); err != nil {
				return n, err
			}
			n++
		}
	}
	slog.Info("shared blob store: forgot a home", "home", home, "pins", n)
	return n, x.Shared.DeleteRecord(ctx, "homes/"+home+".json")
}
