package microvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"stasis/errdefs"
	"stasis/internal/flock"
	"stasis/internal/providers/hostkeep"
	"stasis/internal/providers/microvm/vmstate"
	"stasis/internal/storage/cas"
	"stasis/sandbox"
)

// stateFile is the migration stream's name inside a stored snapshot tree.
const stateFile = "vm.state"

// snapMeta is snapshots/microvm/ID.json.
type snapMeta struct {
	hostkeep.SnapMeta
	VM  vmConfig          `json:"vm"` // the machine the state was saved from
	Env map[string]string `json:"env,omitempty"`
	// Paused is how long the guest was stopped for the save.
	Paused time.Duration `json:"paused_ns"`
	// Cut says how the state was cut into chunks.
	Cut string `json:"cut,omitempty"`
}

func (s snapMeta) info() sandbox.SnapshotInfo {
	in := s.Info(Name)
	in.KeepsProcesses, in.Image = true, s.VM.Image
	return in
}

// Snapshot stops the guest, has QEMU migrate its whole state (memory and
// devices: the processes and the RAM root file system) into a pack file of
// the blob store that is staged as it is written (see save), lets the
// guest run on once QEMU is done, and makes the state durable. The state
// is staged on the sandbox's base (the state it was forked from, or its
// last snapshot's), whose chunks it reuses however old; with a shared
// store, the new state and the read-only disks it stored there become
// the sandbox's published base (hostkeep.Sandboxes.Rebase).
func (p *Provider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	if _, _, err := p.sbs.Live("snapshot", id); err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	unlock, err := flock.Lock(filepath.Join(p.sbDir(id), lockFile), true)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	defer unlock()
	// Read under the lock: the base is the last snapshot's, which no other
	// snapshot of this sandbox replaces (and unpublishes) meanwhile.
	m, _, err := p.sbs.Live("snapshot", id)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	// The shared lock keeps a garbage collection from taking chunks this
	// snapshot finds already stored.
	unlockBlobs, err := p.snaps.LockBlobs(false)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	defer unlockBlobs()
	staged, sv, err := p.save(ctx, id, m.VM.MemMiB, m.LastManifest)
	if err != nil {
		if _, err2 := p.sbs.Running("snapshot", m); err2 != nil {
			return sandbox.SnapshotInfo{}, err2
		}
		return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: %w", what(id), err)
	}
	manifest, st, err := staged.Commit(ctx)
	if err != nil {
		return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: store the state: %w", what(id), err)
	}
	vm := m.VM
	vm.Port, vm.Incoming, vm.IncomingStream = 0, nil, false
	vm.Binds = slices.Clone(m.VM.Binds)
	// With a shared store, the read-only disks go there too (once each),
	// so that another node can fork the machine; the record names their
	// manifests among those it uses, which every collection keeps.
	if err := p.storeDisks(ctx, &vm); err != nil {
		return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: %w", what(id), err)
	}
	s := snapMeta{SnapMeta: hostkeep.SnapMeta{Name: name, Sandbox: id, Manifest: manifest, Uses: vm.diskManifests(), Created: p.o.Now().UTC(), Bytes: st.Bytes, NewBytes: st.NewBytes},
		VM: vm, Env: m.Env, Paused: sv.Paused, Cut: sv.Cut}
	if err := p.snaps.Add(&s); err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	err = p.sbs.Rebase(id, func(m *meta) {
		m.LastManifest = manifest
		m.VM.DiskManifest = vm.DiskManifest
		if len(m.VM.Binds) == len(vm.Binds) {
			for i := range vm.Binds {
				m.VM.Binds[i].Manifest = vm.Binds[i].Manifest
			}
		}
	})
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	return s.info(), nil
}

// save stops the VM and has QEMU migrate its state straight into a new
// pack file of the blob store, which is staged as QEMU writes it: read
// through a mapping of the file, cut by guest address
// (vmstate.Splitter) and hashed on every core, each chunk not stored yet
// kept where QEMU wrote it (its write-back starting at once), the bytes
// of the others released. The guest goes on once the migration has
// completed; save returns when the last chunk is staged. The state's
// bytes are written once, by QEMU, and never pass through this process on
// their way to disk. A migration that does not complete stages nothing.
// The chunks of base (the sandbox's published base, or "") count as
// stored however old their copies are (cas.Store.StageFile).
func (p *Provider) save(ctx context.Context, id string, memMiB int, base string) (*cas.Staged, SaveInfo, error) {
	var sv SaveInfo
	mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	mon, err := monitor(mctx, qmpPath(id))
	cancel()
	if err != nil {
		return nil, sv, err
	}
	defer mon.Close()
	// The default bandwidth cap (128 MiB/s) would set the pace of a
	// stopped guest's save; the disk sets it instead.
	if err := qmpRun(mon, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
		return nil, sv, err
	}
	pf, err := p.blobs.NewPackFile()
	if err != nil {
		return nil, sv, err
	}
	// The mapping spans the most the state can take: the guest's memory,
	// an 8-byte header per page, the device state and room to spare.
	mem := int64(memMiB) << 20
	limit := mem + mem/256 + 64<<20
	data, err := unix.Mmap(int(pf.File().Fd()), 0, int(limit), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		pf.Abort()
		return nil, sv, fmt.Errorf("map the state file: %w", err)
	}
	// Staging runs from here on, waiting for the bytes it needs as QEMU
	// writes them; from here on it owns pf (StageFile aborts it should it
	// fail) and the mapping outlives it.
	defer unix.Munmap(data)
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	w := &written{f: pf.File(), limit: limit, ctx: sctx, done: make(chan struct{})}
	sp := vmstate.NewGrowingSplitter(data, w.avail)
	type result struct {
		st  *cas.Staged
		err error
	}
	res := make(chan result, 1)
	go func() {
		st, err := p.snaps.CAS.StageFile(sctx, stateFile, pf, sp, base)
		res <- result{st, err}
	}()
	fail := func(err error) (*cas.Staged, SaveInfo, error) {
		w.end()
		scancel()
		if r := <-res; r.st != nil {
			r.st.Abort()
		} else if r.err != nil && !errors.Is(r.err, context.Canceled) {
			err = fmt.Errorf("%w (staging the state: %v)", err, r.err)
		}
		return nil, sv, err
	}
	start := time.Now()
	if err := qmpRun(mon, "stop", nil, nil); err != nil {
		return fail(err)
	}
	defer func() { _ = qmpRun(mon, "cont", nil, nil) }()
	// QEMU writes the state straight into the pack file, a copy of whose
	// descriptor it is handed.
	if err := qmpRunFD(mon, "getfd", map[string]any{"fdname": "state"}, nil, pf.File()); err != nil {
		return fail(err)
	}
	if err := qmpRun(mon, "migrate", map[string]any{"uri": "fd:state"}, nil); err != nil {
		_ = qmpRun(mon, "closefd", map[string]any{"fdname": "state"}, nil) // QEMU's copy of the file
		return fail(err)
	}
	if p.o.SnapshotHook != nil {
		if err := p.o.SnapshotHook(id); err != nil {
			return fail(err)
		}
	}
	if _, err := waitMigration(ctx, mon); err != nil {
		return fail(err)
	}
	w.end() // QEMU has written the whole state
	// The guest goes on while the last chunks are staged.
	if err := qmpRun(mon, "cont", nil, nil); err != nil {
		return fail(err)
	}
	sv.Paused = time.Since(start)
	r := <-res
	if r.err != nil {
		return nil, sv, r.err
	}
	fi, err := pf.File().Stat()
	if err == nil && (fi.Size() != r.st.Bytes() || fi.Size() == 0) {
		err = fmt.Errorf("QEMU wrote %d bytes of state and %d were staged (at most %d fit the mapping)", fi.Size(), r.st.Bytes(), limit)
	}
	if err != nil {
		r.st.Abort()
		return nil, sv, err
	}
	ok, why, pages := sp.Parsed()
	if ok {
		sv.Cut = fmt.Sprintf("%s (%d pages)", cutByAddress, pages)
	} else {
		sv.Cut = "fixed-size, after " + strconv.FormatInt(pages, 10) + " pages: " + why
		slog.Warn("the migration stream was not understood; it is stored in fixed-size chunks, which deduplicate poorly", "sandbox", id, "why", why, "pages", pages)
	}
	return r.st, sv, nil
}

// written tells a growing Splitter how much of the state file QEMU has
// written: it polls the file's size until there is enough, QEMU is done,
// or staging is cancelled.
type written struct {
	f     *os.File
	limit int64
	ctx   context.Context
	done  chan struct{}
	once  sync.Once
}

// end says QEMU writes no more.
func (w *written) end() { w.once.Do(func() { close(w.done) }) }

func (w *written) size() int {
	fi, err := w.f.Stat()
	if err != nil {
		return 0
	}
	return int(min(fi.Size(), w.limit))
}

func (w *written) avail(need int) int {
	for {
		n := w.size()
		if n >= need || n >= int(w.limit) {
			return n
		}
		select {
		case <-w.done:
			return w.size()
		case <-w.ctx.Done():
			return n
		case <-time.After(500 * time.Microsecond): // QEMU writes about a megabyte meanwhile
		}
	}
}

// SaveInfo is how a snapshot was saved.
type SaveInfo struct {
	// Paused is how long the guest was stopped: QEMU writing its state
	// into the blob store (cutting, hashing and making the chunks durable
	// come after the guest went on).
	Paused time.Duration
	// Cut says how the state was cut into chunks: "by guest address (N
	// pages)", or fixed-size and why.
	Cut string
}

// ByAddress reports whether the state was cut by guest address.
func (i SaveInfo) ByAddress() bool { return strings.HasPrefix(i.Cut, cutByAddress) }

const cutByAddress = "by guest address"

// Saved says how snapshot was saved.
func (p *Provider) Saved(snapshot string) (SaveInfo, error) {
	s, err := p.snaps.Read("get", snapshot)
	return SaveInfo{Paused: s.Paused, Cut: s.Cut}, err
}

// Fork starts n microVMs from a snapshot, all or nothing: each fork's
// QEMU starts with its own port and loads the state streamed out of the
// store; the snapshot's processes continue in each.
func (p *Provider) Fork(ctx context.Context, snap string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	s, err := p.snaps.ForFork(snap, n, spec.Expiry)
	if err != nil {
		return nil, err
	}
	// Another node's files, where they are not this one's (a shared
	// store): this node's own, or a refusal.
	if s.VM, err = p.machineHere(ctx, snap, s.VM); err != nil {
		return nil, err
	}
	// Each fork's QEMU streams the state out of the blob store (no file
	// is written); the shared lock keeps a garbage collection from taking
	// its chunks meanwhile. From a directory store, QEMU runs `stasis
	// microvm state`; from a shared one, this process writes the state
	// to QEMU itself, through the store's read cache (which one process
	// holds).
	unlockBlobs, err := p.snaps.LockBlobs(false)
	if err != nil {
		return nil, err
	}
	defer unlockBlobs()
	var state []string
	var cat func(context.Context, io.Writer) error
	if p.shared() {
		cat = func(ctx context.Context, w io.Writer) error {
			return p.snaps.CAS.CatFile(ctx, s.Manifest, stateFile, w)
		}
	} else {
		state = []string{p.o.Exe, "microvm", "state", "--blobs", p.blobDir(), "--manifest", s.Manifest}
	}

	made := make([]sandbox.Info, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		if p.o.ForkHook != nil {
			if err := p.o.ForkHook(snap, i); err != nil {
				errs[i] = err
				continue
			}
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			made[i], errs[i] = p.forkOne(ctx, s, state, cat, spec)
		}(i)
	}
	wg.Wait()
	for i, err := range errs {
		if err == nil {
			continue
		}
		for _, info := range made {
			if info.ID != "" {
				_ = p.retire(info.ID)
			}
		}
		return nil, fmt.Errorf("fork %s: sandbox %d of %d failed, so none was kept: %w", snap, i+1, n, err)
	}
	return made, nil
}

// forkOne makes one sandbox of a Fork. Its directory is made, and (with
// a shared store) the snapshot's manifests published as its base
// (hostkeep.Snapshots.PinFork: its saved state and its read-only disks),
// before a blob of them is read; they stay published while the sandbox
// is there: the state as the base its next snapshot is staged on, the
// disks as those it stores again (see storeDisk).
func (p *Provider) forkOne(ctx context.Context, s snapMeta, state []string, cat func(context.Context, io.Writer) error, spec sandbox.ForkSpec) (sandbox.Info, error) {
	m := meta{Meta: hostkeep.Meta{ID: hostkeep.NewID("vm-"), Labels: spec.Labels, Env: s.Env, Created: p.o.Now().UTC(), Expiry: spec.Expiry.UTC(), Source: s.ID, LastManifest: s.Manifest}, VM: s.VM}
	m.VM.Binds = slices.Clone(s.VM.Binds) // each fork's own (disksHere)
	m.VM.Incoming, m.VM.IncomingStream = state, cat != nil
	// A fork's gateway is this provider's (the host's socket may have
	// moved since the save).
	m.VM.Gateway, m.VM.Pipe = p.gateway(m.ID)
	if err := os.MkdirAll(p.sbDir(m.ID), 0o700); err != nil {
		return sandbox.Info{}, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = p.retire(m.ID)
		}
	}()
	if err := p.snaps.PinFork(ctx, m.ID, s); err != nil {
		return sandbox.Info{}, err
	}
	if err := p.disksHere(ctx, s.ID, &m.VM); err != nil {
		return sandbox.Info{}, err
	}
	if err := p.checkDisks(s.ID, m.VM); err != nil {
		return sandbox.Info{}, err
	}
	if err := p.boot(ctx, &m, cat); err != nil {
		return sandbox.Info{}, err
	}
	// The state is loaded; QEMU reads it no more.
	loaded, err := p.sbs.Rewrite("fork", m.ID, func(m *meta) error {
		m.VM.Incoming, m.VM.IncomingStream = nil, false
		return nil
	})
	if err != nil {
		return sandbox.Info{}, err
	}
	ok = true
	return p.info(loaded, sandbox.StateRunning), nil
}

// checkDisks refuses to fork snapshot snap onto read-only disks vm (this
// node's: see disksHere) that are not the very files its saved machine
// had.
func (p *Provider) checkDisks(snap string, vm vmConfig) error {
	elsewhere := ""
	if p.shared() {
		elsewhere = " (or the snapshot was saved on another node, whose file that was, and by a stasis that did not store it)"
	}
	if vm.Disk != "" {
		// The saved machine had the image attached: its forks need the
		// same file.
		id, err := fileID(vm.Disk)
		if err != nil {
			return sandbox.Errorf(errdefs.ErrNotFound, "fork", "snapshot "+snap, "its image's block file %s is missing (image %s removed?%s); the saved machine needs that very file, so this snapshot cannot be forked: %v", vm.Disk, vm.Image, elsewhere, err)
		}
		if vm.DiskID != "" && id != vm.DiskID {
			return sandbox.Errorf(errdefs.ErrConflict, "fork", "snapshot "+snap, "its image's block file %s was built again since the snapshot (image %s removed and pulled again?%s); the saved machine's view of the old one would not match it, so this snapshot cannot be forked", vm.Disk, vm.Image, elsewhere)
		}
	}
	if err := checkBindDisks(vm.Binds); err != nil {
		return sandbox.Errorf(errdefs.ErrConflict, "fork", "snapshot "+snap, "%v%s; the saved machine needs that very file, so this snapshot cannot be forked", err, elsewhere)
	}
	return nil
}

// machineHere is the saved machine vm as this node starts it. From a
// directory store it is vm itself (the snapshot was saved here). From a
// shared store it may have been saved on another node, whose QEMU,
// kernel and guest image are files of that node: each is this node's own
// when it is the same (the guest image by its name, a digest of what it
// was built from; the kernel by its file's name, which holds its version;
// QEMU by its name), else the saved path if this node has that file,
// else the fork is refused. The read-only disks must be the very files
// the guest saw: each fork finds this node's copies of them out of the
// store where they are not here (disksHere), once it has published them
// as its base, and checks them (checkDisks).
func (p *Provider) machineHere(ctx context.Context, snap string, vm vmConfig) (vmConfig, error) {
	if !p.shared() {
		return vm, nil
	}
	if err := p.Prepare(ctx); err != nil {
		return vm, err
	}
	var err error
	here := func(saved, mine, what string) string {
		if err != nil || saved == "" || filepath.Base(saved) == filepath.Base(mine) {
			return mine
		}
		if _, serr := os.Stat(saved); serr == nil {
			return saved
		}
		err = sandbox.Errorf(errdefs.ErrConflict, "fork", "snapshot "+snap, "it was saved on a node whose %s was %s, which this node does not have (its own is %s): fork it on a node with the same stasis, busybox, guest kernel and QEMU", what, saved, mine)
		return saved
	}
	vm.QEMU = here(vm.QEMU, p.qemu, "QEMU")
	vm.Kernel = here(vm.Kernel, p.kernel.Image, "guest kernel")
	vm.Initramfs = here(vm.Initramfs, p.initramfs, "guest image")
	return vm, err
}
