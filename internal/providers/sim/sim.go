// Package sim owns the simulated sandbox provider ("sim"): sandboxes that
// are records in the host process's memory, for benchmarks and tests of
// stasis's own host side at scale (thousands of episodes on a node), never
// for running an agent. Nothing is isolated and no program runs: a
// sandbox is a small in-memory file tree, and Exec interprets a POSIX
// shell over it (mvdan.cc/sh) with a handful of file utilities, plus the
// in-sandbox stasis commands the host runs through Exec (supervise, ctl,
// clock set). A simulated supervisor is the real one's state machine
// (supervisor.Machine) over a process layer whose harness runs nothing:
// it refuses what the real one refuses, in the same JSON; a pause holds a
// relay that has delivered no call, because no harness makes one.
//
// Snapshots cost nothing but keep what a fork needs: a copy of the file
// tree (contents shared) and of every supervisor's machine, so forks
// keep processes (Capabilities.KeepsProcesses) and resume in place, with
// the guest's uptime continuing from the snapshot and its wall clock set
// by `clock set`. The sandboxes live as long as the process: another
// Provider opened on the same Home in the same process finds them; a new
// process finds none.
package sim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"io/fs"
	"maps"
	"path"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
)

// Name is the provider's name in the registry.
const Name = "sim"

// Help says what the provider is for, where a command lists providers.
const Help = "sim (simulated, for benchmarks and tests of stasis itself: in-memory sandboxes that run no program and isolate nothing; never for agents)"

func init() {
	sandbox.Register(Name, sandbox.Driver{
		// No relay runs in a simulated sandbox; this is where one would
		// dial, as in a host provider's sandbox.
		GatewayURL: "unix:///stasis/gateway/gw.sock",
		NoFreeze:   "simulated sandboxes have no control groups",
		Open: func(_ context.Context, c sandbox.Config) (sandbox.Provider, error) {
			return Open(c.Home, c.Binary != ""), nil
		},
	})
}

// world is every simulated sandbox and snapshot of one Home.
type world struct {
	mu        sync.Mutex
	sandboxes map[string]*box
	gone      map[string]error // deleted (ErrNotFound) or expired (ErrExpired)
	snaps     map[string]*snap
	deleted   map[string]bool // snapshot ids deleted: never reused
	retired   map[string]int  // how many times each sandbox was retired
	failFork  map[string]map[int]bool
	binary    bool // sandboxes have the stasis binary at sandbox.BinaryPath
}

var worlds = struct {
	sync.Mutex
	m map[string]*world
}{m: map[string]*world{}}

// Provider is the simulated provider over one Home's world.
type Provider struct{ w *world }

// Open returns the provider of home's simulated sandboxes (made the first
// time); binary puts a stand-in for the stasis binary at
// sandbox.BinaryPath in every sandbox, as a host provider binds it in.
func Open(home string, binary bool) *Provider {
	worlds.Lock()
	defer worlds.Unlock()
	w, ok := worlds.m[home]
	if !ok {
		w = &world{
			sandboxes: map[string]*box{}, gone: map[string]error{}, snaps: map[string]*snap{},
			deleted: map[string]bool{}, retired: map[string]int{}, failFork: map[string]map[int]bool{},
		}
		worlds.m[home] = w
	}
	w.binary = w.binary || binary
	return &Provider{w: w}
}

// box is one simulated sandbox.
type box struct {
	w  *world
	mu sync.Mutex
	// info's ID, Labels, Created, Source and Image never change; Expiry
	// does, under mu.
	info    sandbox.Info
	env     map[string]string
	fs      files
	sups    map[string]*sup // by session directory
	boot    time.Time       // the guest's uptime counts from here
	wallOff atomic.Int64    // the guest's wall clock minus the host's, in ns
	nextPID atomic.Int64
	expire  *time.Timer
	dead    bool
}

// snap is a snapshot: the files and the supervisors' machines at the time.
type snap struct {
	info    sandbox.SnapshotInfo
	env     map[string]string
	fs      files
	sups    map[string]*sup // copies, driving nothing
	uptime  time.Duration
	wallOff int64
	nextPID int64
}

func newID(prefix string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// Name implements sandbox.Lifecycle.
func (p *Provider) Name() string { return Name }

// Capabilities implements sandbox.Lifecycle: snapshots keep processes and
// outlive their source; one user; no freezer.
func (p *Provider) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{KeepsProcesses: true, SnapshotOutlivesSource: true}
}

// Close implements sandbox.Lifecycle; the sandboxes live on in the process.
func (p *Provider) Close() error { return nil }

// FailFork makes the k-th sandbox of every fork of snapshot fail until
// undone (the conformance suite's hook).
func (p *Provider) FailFork(snapshot string, k int) (undo func()) {
	p.w.mu.Lock()
	defer p.w.mu.Unlock()
	if p.w.failFork[snapshot] == nil {
		p.w.failFork[snapshot] = map[int]bool{}
	}
	p.w.failFork[snapshot][k] = true
	return func() {
		p.w.mu.Lock()
		defer p.w.mu.Unlock()
		delete(p.w.failFork[snapshot], k)
	}
}

// Retired reports how many times sandbox id was retired.
func (p *Provider) Retired(id string) int {
	p.w.mu.Lock()
	defer p.w.mu.Unlock()
	return p.w.retired[id]
}

func (p *Provider) checkExpiry(op string, t time.Time) error {
	if t.IsZero() || !t.After(time.Now()) {
		return sandbox.Errorf(errdefs.ErrInvalid, op, "", "expiry %s is not in the future: give an absolute time ahead of now", t.Format(time.RFC3339))
	}
	return nil
}

// Create implements sandbox.Lifecycle: the work tree is seeded from
// spec.Root and spec.Files; an image is not supported.
func (p *Provider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	if err := p.checkExpiry("create", spec.Expiry); err != nil {
		return sandbox.Info{}, err
	}
	if spec.Image != "" {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrUnsupported, "create", "", "image %q: simulated sandboxes have no images", spec.Image)
	}
	if err := spec.Limits.Check(); err != nil {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "%v", err)
	}
	now := time.Now()
	b := &box{
		w: p.w, env: maps.Clone(spec.Env), fs: newFiles(now), sups: map[string]*sup{}, boot: now,
		info: sandbox.Info{ID: newID("sim-"), Provider: Name, State: sandbox.StateRunning, Labels: maps.Clone(spec.Labels), Created: now, Expiry: spec.Expiry},
	}
	b.nextPID.Store(1)
	if p.w.binary {
		b.fs["/stasis/bin/stasis"] = entry{mode: 0o755, data: binaryStandIn, mtime: now}
	}
	if spec.Root != "" {
		if err := b.fs.seedFrom(spec.Root, "/work", now); err != nil {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "seed /work from %s: %v", spec.Root, err)
		}
	}
	for name, data := range spec.Files {
		name = clean("/", name)
		if err := b.fs.mkdirAll(path.Dir(name), 0o755, now); err != nil {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "file %s: %v", name, err)
		}
		if err := b.fs.write(name, data, 0o644, now); err != nil {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "file %s: %v", name, err)
		}
	}
	p.add(b)
	return b.snapshotInfo(), nil
}

// add registers b and arms its expiry.
func (p *Provider) add(b *box) {
	p.w.mu.Lock()
	p.w.sandboxes[b.info.ID] = b
	p.w.mu.Unlock()
	b.mu.Lock()
	b.armExpiry()
	b.mu.Unlock()
}

// armExpiry (b.mu held) ends the sandbox at its expiry, on the host's
// side: nothing inside can move it.
func (b *box) armExpiry() {
	if b.expire != nil {
		b.expire.Stop()
	}
	id := b.info.ID
	b.expire = time.AfterFunc(time.Until(b.info.Expiry), func() { b.w.retire(id, errdefs.ErrExpired) })
}

// snapshotInfo is b's Info (b.mu not needed for the fixed fields).
func (b *box) snapshotInfo() sandbox.Info {
	in := b.info
	in.Labels = maps.Clone(in.Labels)
	desc, _ := json.Marshal(map[string]string{"id": in.ID})
	in.Descriptor = desc
	return in
}

// retire removes sandbox id once: its supervisors stop, and the id is
// remembered as why (ErrNotFound deleted, ErrExpired expired).
func (w *world) retire(id string, why error) bool {
	w.mu.Lock()
	b, ok := w.sandboxes[id]
	if ok {
		delete(w.sandboxes, id)
		w.gone[id] = why
		w.retired[id]++
	}
	w.mu.Unlock()
	if !ok {
		return false
	}
	b.mu.Lock()
	b.dead = true
	if b.expire != nil {
		b.expire.Stop()
	}
	sups := b.sups
	b.sups = nil
	b.fs = nil
	b.mu.Unlock()
	for _, s := range sups {
		s.kill()
	}
	return true
}

// get finds a live sandbox.
func (p *Provider) get(op, id string) (*box, error) {
	p.w.mu.Lock()
	b, ok := p.w.sandboxes[id]
	why := p.w.gone[id]
	p.w.mu.Unlock()
	if ok {
		b.mu.Lock()
		expired := !time.Now().Before(b.info.Expiry)
		b.mu.Unlock()
		if !expired {
			return b, nil
		}
		p.w.retire(id, errdefs.ErrExpired)
		why = errdefs.ErrExpired
	}
	if why == errdefs.ErrExpired {
		return nil, sandbox.Errorf(errdefs.ErrExpired, op, "sandbox "+id, "its expiry passed")
	}
	return nil, sandbox.Errorf(errdefs.ErrNotFound, op, "sandbox "+id, "no such simulated sandbox (they live only in the process that made them)")
}

// Get implements sandbox.Lifecycle.
func (p *Provider) Get(ctx context.Context, id string) (sandbox.Info, error) {
	b, err := p.get("get", id)
	if err != nil {
		return sandbox.Info{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.snapshotInfo(), nil
}

// List implements sandbox.Lifecycle.
func (p *Provider) List(ctx context.Context, labels map[string]string) ([]sandbox.Info, error) {
	p.w.mu.Lock()
	bs := make([]*box, 0, len(p.w.sandboxes))
	for _, b := range p.w.sandboxes {
		bs = append(bs, b)
	}
	p.w.mu.Unlock()
	var out []sandbox.Info
	now := time.Now()
	for _, b := range bs {
		b.mu.Lock()
		in := b.snapshotInfo()
		b.mu.Unlock()
		if !now.Before(in.Expiry) {
			continue
		}
		match := true
		for k, v := range labels {
			if in.Labels[k] != v {
				match = false
				break
			}
		}
		if match {
			out = append(out, in)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// Delete implements sandbox.Lifecycle; deleting one already gone is nil.
func (p *Provider) Delete(ctx context.Context, id string) error {
	p.w.retire(id, errdefs.ErrNotFound)
	return nil
}

// SetExpiry implements sandbox.Lifecycle.
func (p *Provider) SetExpiry(ctx context.Context, id string, t time.Time) error {
	b, err := p.get("set-expiry", id)
	if err != nil {
		return err
	}
	if err := p.checkExpiry("set-expiry", t); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.info.Expiry = t
	b.armExpiry()
	return nil
}

// GC implements sandbox.Lifecycle: a simulated sandbox has no host side
// that can die, and one past its expiry is retired by its timer; GC
// retires any the timer has not reached yet.
func (p *Provider) GC(ctx context.Context) ([]string, error) {
	p.w.mu.Lock()
	var late []string
	now := time.Now()
	for id, b := range p.w.sandboxes {
		b.mu.Lock()
		if !now.Before(b.info.Expiry) {
			late = append(late, id)
		}
		b.mu.Unlock()
	}
	p.w.mu.Unlock()
	var out []string
	for _, id := range late {
		if p.w.retire(id, errdefs.ErrExpired) {
			out = append(out, id)
		}
	}
	return out, nil
}

// ReadFile implements sandbox.Files.
func (p *Provider) ReadFile(ctx context.Context, id, name string) ([]byte, error) {
	b, err := p.get("read", id)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return nil, sandbox.Errorf(errdefs.ErrNotFound, "read", "sandbox "+id, "deleted")
	}
	data, err := b.fs.read(clean("/work", name))
	if err != nil {
		return nil, sandbox.Errorf(errdefs.ErrNotFound, "read", name+" in "+id, "%v", err)
	}
	return data, nil
}

// WriteFile implements sandbox.Files: the directories on the way are made.
func (p *Provider) WriteFile(ctx context.Context, id, name string, data []byte, mode fs.FileMode) error {
	b, err := p.get("write", id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return sandbox.Errorf(errdefs.ErrNotFound, "write", "sandbox "+id, "deleted")
	}
	name = clean("/work", name)
	now := time.Now()
	if err := b.fs.mkdirAll(path.Dir(name), 0o755, now); err != nil {
		return sandbox.Errorf(errdefs.ErrInvalid, "write", name+" in "+id, "%v", err)
	}
	if err := b.fs.write(name, data, mode, now); err != nil {
		return sandbox.Errorf(errdefs.ErrInvalid, "write", name+" in "+id, "%v", err)
	}
	return nil
}

// Upload implements sandbox.Files.
func (p *Provider) Upload(ctx context.Context, id, dir string, tr io.Reader) error {
	b, err := p.get("upload", id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return sandbox.Errorf(errdefs.ErrNotFound, "upload", "sandbox "+id, "deleted")
	}
	if err := b.fs.untar(clean("/work", dir), tr, time.Now()); err != nil {
		return sandbox.Errorf(errdefs.ErrInvalid, "upload", dir+" in "+id, "%v", err)
	}
	return nil
}

// Download implements sandbox.Files.
func (p *Provider) Download(ctx context.Context, id, dir string, w io.Writer) error {
	b, err := p.get("download", id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return sandbox.Errorf(errdefs.ErrNotFound, "download", "sandbox "+id, "deleted")
	}
	if err := b.fs.tar(clean("/work", dir), w); err != nil {
		return sandbox.Errorf(errdefs.ErrNotFound, "download", dir+" in "+id, "%v", err)
	}
	return nil
}

// Snapshot implements sandbox.Snapshots: a copy of the file tree's index
// and of each supervisor's machine, taken at one instant under the
// sandbox's lock (atomic over its processes, as a memory image is).
func (p *Provider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	b, err := p.get("snapshot", id)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	b.mu.Lock()
	if b.dead {
		b.mu.Unlock()
		return sandbox.SnapshotInfo{}, sandbox.Errorf(errdefs.ErrNotFound, "snapshot", "sandbox "+id, "deleted")
	}
	s := &snap{
		env: b.env, fs: maps.Clone(b.fs), sups: make(map[string]*sup, len(b.sups)),
		uptime: time.Since(b.boot), wallOff: b.wallOff.Load(), nextPID: b.nextPID.Load(),
	}
	for dir, sp := range b.sups {
		s.sups[dir] = sp.frozen()
	}
	b.mu.Unlock()
	p.w.mu.Lock()
	defer p.w.mu.Unlock()
	sid := newID("simsnap-")
	for p.w.snaps[sid] != nil || p.w.deleted[sid] {
		sid = newID("simsnap-")
	}
	s.info = sandbox.SnapshotInfo{ID: sid, Name: name, Sandbox: id, Provider: Name, Created: time.Now(), KeepsProcesses: true}
	p.w.snaps[sid] = s
	return s.info, nil
}

// Fork implements sandbox.Snapshots: n sandboxes, each with the
// snapshot's files and its supervisors continuing from where they were;
// all or nothing.
func (p *Provider) Fork(ctx context.Context, snapshot string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	if n < 1 {
		return nil, sandbox.Errorf(errdefs.ErrInvalid, "fork", "snapshot "+snapshot, "count %d: give at least 1", n)
	}
	if err := p.checkExpiry("fork", spec.Expiry); err != nil {
		return nil, err
	}
	p.w.mu.Lock()
	s, ok := p.w.snaps[snapshot]
	fail := maps.Clone(p.w.failFork[snapshot])
	p.w.mu.Unlock()
	if !ok {
		return nil, sandbox.Errorf(errdefs.ErrNotFound, "fork", "snapshot "+snapshot, "no such simulated snapshot")
	}
	var made []*box
	for k := range n {
		if fail[k] {
			for _, b := range made {
				p.w.retire(b.info.ID, errdefs.ErrNotFound)
			}
			return nil, sandbox.Errorf(errdefs.ErrUnavailable, "fork", "snapshot "+snapshot, "sandbox %d of %d failed (injected); none of the %d is left", k+1, n, n)
		}
		now := time.Now()
		b := &box{
			w: p.w, env: s.env, fs: maps.Clone(s.fs), sups: map[string]*sup{}, boot: now.Add(-s.uptime),
			info: sandbox.Info{ID: newID("sim-"), Provider: Name, State: sandbox.StateRunning, Labels: maps.Clone(spec.Labels), Created: now, Expiry: spec.Expiry, Source: snapshot},
		}
		b.wallOff.Store(s.wallOff)
		b.nextPID.Store(s.nextPID)
		for dir, sp := range s.sups {
			b.sups[dir] = sp.thaw(b)
		}
		p.add(b)
		made = append(made, b)
	}
	out := make([]sandbox.Info, len(made))
	for i, b := range made {
		out[i] = b.snapshotInfo()
	}
	return out, nil
}

// GetSnapshot implements sandbox.Snapshots.
func (p *Provider) GetSnapshot(ctx context.Context, snapshot string) (sandbox.SnapshotInfo, error) {
	p.w.mu.Lock()
	defer p.w.mu.Unlock()
	s, ok := p.w.snaps[snapshot]
	if !ok {
		return sandbox.SnapshotInfo{}, sandbox.Errorf(errdefs.ErrNotFound, "get-snapshot", "snapshot "+snapshot, "no such simulated snapshot")
	}
	return s.info, nil
}

// DeleteSnapshot implements sandbox.Snapshots; idempotent.
func (p *Provider) DeleteSnapshot(ctx context.Context, snapshot string) error {
	p.w.mu.Lock()
	defer p.w.mu.Unlock()
	if _, ok := p.w.snaps[snapshot]; ok {
		delete(p.w.snaps, snapshot)
		p.w.deleted[snapshot] = true
	}
	return nil
}

// CollectBlobs implements sandbox.Snapshots: a deleted snapshot's memory
// is the Go collector's, so there is nothing to free here.
func (p *Provider) CollectBlobs(ctx context.Context) (int, int64, error) { return 0, 0, nil }
