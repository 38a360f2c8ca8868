// Package microvm owns the microVM provider: one QEMU virtual machine per
// sandbox (machine type microvm, the Debian cloud kernel, an initramfs of
// busybox and a static stasis built by this package), whose root file
// system lives in guest RAM, so that a memory snapshot holds files and
// processes alike. A snapshot is a QEMU migration written straight into a
// pack file of the blob store and staged by the cas package as QEMU writes
// it, cut into chunks by guest address (internal/providers/microvm/vmstate), so that
// snapshots of one VM and forks of forks share the pages that did not
// change; a fork starts new QEMU processes from a saved state, and the
// processes of the snapshot continue in each (keeps_processes). The blob
// store is a directory in the state directory, or an S3 bucket shared by
// the nodes of a cluster (Options.Blobs), which then holds the snapshots'
// records and the guests' read-only disks as well (shareddisk.go), so
// that any node forks any node's snapshot with its processes; each
// sandbox publishes there what it builds on (the saved state its next
// snapshot is staged on, its disks' copies), so that a collection on any
// node frees only what no snapshot and no sandbox anywhere uses
// (hostkeep.ShareBlobs).
//
// The host reaches the guest agent (internal/providers/microvm/agent, run by busybox
// init from the stasis binary in the image) over QEMU's user-mode network:
// a loopback port forwarded to the agent, one per sandbox. The guest
// reaches nothing but what QEMU forwards (restrict=on): GatewayAddr leads,
// one `stasis microvm pipe` per connection, to the host's gateway socket
// (with Options.GatewayDir, a socket of that sandbox's own), so the relay
// in the guest talks to the gateway as it does from a local sandbox. A keeper process per sandbox (`stasis microvm keeper`) owns the
// QEMU and enforces the absolute expiry; GC ends QEMUs whose keeper died.
package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"stasis/errdefs"
	"stasis/internal/control/image"
	"stasis/internal/flock"
	"stasis/internal/guestclock"
	"stasis/internal/proc"
	"stasis/internal/providers/hostkeep"
	"stasis/internal/providers/microvm/agent"
	"stasis/internal/sandboxbin"
	"stasis/internal/storage/blob"
	"stasis/internal/storage/cas"
	"stasis/sandbox"
)

// Name is the provider's name in records and on the command line.
const Name = "microvm"

// KernelEnv names the directory holding the unpacked cloud kernel package.
const KernelEnv = "STASIS_MICROVM_KERNEL"

// DefaultMemMiB is a guest's memory unless Options.MemMiB says otherwise:
// room for OpenCode, whose guest took about 650 MiB at its peak
// (BENCHMARKS.md, "OpenCode in a guest"). A guest's untouched memory costs
// the host nothing and its snapshot a flag per page.
const DefaultMemMiB = 1024

// Options configure the provider.
type Options struct {
	// Home is the state directory ($STASIS_HOME).
	Home string
	// Blobs, when set, is an S3 URL (s3://BUCKET/PREFIX, with the AWS
	// environment variables for its endpoint and credentials) where the
	// snapshots' saved states and records are kept instead of Home,
	// shared by the providers of every node on it: any of them forks any
	// snapshot, its processes continuing in place. A fork streams the
	// state out of S3 through a bounded, verified read cache in Home
	// (vmblob-cache); a save is staged there and uploaded (a multipart
	// upload). The sandboxes' bases (the saved state each builds its next
	// snapshot on, and its read-only disks stored there) are published
	// in the store, so that a collection on any node, of any provider,
	// keeps them (hostkeep.ShareBlobs); deleting a snapshot collects
	// what nothing uses any more.
	Blobs string
	// Share tunes the collection of a shared Blobs store (zero fields:
	// hostkeep's defaults).
	Share hostkeep.ShareOptions
	// Exe is the stasis binary that runs keepers and gateway pipes on the
	// host (default: this executable); ExeEnv is extra environment for it.
	Exe    string
	ExeEnv []string
	// GuestBinary is the static stasis binary put in the guest image
	// (default: Exe, when it is static).
	GuestBinary string
	// KernelDir holds the unpacked linux-image-*-cloud-amd64 package
	// (default: $STASIS_MICROVM_KERNEL).
	KernelDir string
	// Busybox is a static busybox (default: /bin/busybox, from Debian's
	// busybox-static).
	Busybox string
	// MemMiB is each guest's memory (default DefaultMemMiB).
	MemMiB int
	// ReadOnlyBinds: host directory → guest path, each given to every
	// guest read-only as an erofs disk (BindDisk), built once per
	// content of the directory into Home/images.
	ReadOnlyBinds map[string]string
	// Accel forces kvm or tcg; empty probes once and caches the answer.
	Accel string
	// GatewayDir and GatewayServer, when both are set, give every guest a
	// gateway socket of its own: GatewayDir/ID/gw.sock on the
	// host (its directory made with the sandbox, mode 0700, removed with
	// it), which GatewayAddr in that guest alone leads to and which
	// GatewayServer serves. A token bound to one sandbox's socket
	// (relay.Gateway.Bind) is then of no use from any other guest. Unset,
	// the guests reach no gateway.
	GatewayDir    string
	GatewayServer sandbox.GatewayServer
	// BootTimeout bounds a boot or a restore, to the agent answering
	// (default 3m: TCG on a loaded machine is slow, and a 1 GiB guest's state
	// takes a while to load).
	BootTimeout time.Duration
	// SnapshotHook, when set (tests), is called inside each Snapshot while
	// the machine's state is being written: QEMU's migration into the
	// state file started (the guest stopped), its end not yet seen, the
	// staging of its chunks under way. An error fails the snapshot.
	SnapshotHook func(sandbox string) error
	// ForkHook, when set, is called before each sandbox of a Fork is made;
	// an error makes that one fail (tests).
	ForkHook func(snapshot string, i int) error
	// Now is the clock (tests); time.Now when nil.
	Now func() time.Time
}

// Provider is the microVM provider.
type Provider struct {
	o         Options
	kernel    Kernel
	initramfs string
	qemu      string
	accel     string
	accelWhy  string
	tscKHz    int // under TCG, the host's TSC frequency (see vmConfig)
	prepOnce  sync.Once
	prepErr   error
	images    *image.Store

	// The sandboxes ($STASIS_HOME/sandboxes/microvm) and the snapshots
	// ($STASIS_HOME/snapshots/microvm, their saved states in blobs: a
	// blob store at blobDir, or Options.Blobs with the records too), kept
	// as hostkeep keeps them; Calls answers Get, List, SetExpiry,
	// GetSnapshot, DeleteSnapshot and CollectBlobs from them alone.
	sbs   *hostkeep.Sandboxes[meta, *meta, keeperInfo]
	snaps *hostkeep.Snapshots[snapMeta, *snapMeta]
	blobs packStore
	hostkeep.Calls[meta, *meta, keeperInfo, snapMeta, *snapMeta]
	// closeBlobs closes a shared blob store (Options.Blobs), or is nil.
	closeBlobs func() error
	// diskMu is held while a disk is written from a shared store
	// (loadDisk).
	diskMu sync.Mutex
}

// packStore is what the provider needs of its blob store: QEMU migrates
// a saved state straight into one of its pack files (blob.Dir's, or
// blob.S3's staged locally and uploaded).
type packStore interface {
	blob.Store
	blob.PackFiler
}

// Images is the provider's image store ($STASIS_HOME/images, shared with
// the local provider's): a guest's image root is a block image built
// beside the unpacked root (RootImage).
func (p *Provider) Images() *image.Store { return p.images }

// ImageUsers returns, for each image digest, the microVM sandboxes and
// the snapshots (not deleted) of state directory home that use it: a
// snapshot's saved machine needs the image's block file as it was.
func ImageUsers(home string) (sandboxes, snapshots map[string][]string, err error) {
	sandboxes, snapshots = map[string][]string{}, map[string][]string{}
	read := func(dir string, into map[string][]string, isSnap bool) error {
		ents, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		for _, e := range ents {
			path := filepath.Join(dir, e.Name(), hostkeep.MetaFile)
			if isSnap {
				path = filepath.Join(dir, e.Name())
			}
			b, err := os.ReadFile(path)
			if err != nil {
				continue
			}
			var doc struct {
				ID      string   `json:"id"`
				VM      vmConfig `json:"vm"`
				Deleted bool     `json:"deleted"`
			}
			if json.Unmarshal(b, &doc) != nil || doc.VM.Image == "" || doc.Deleted {
				continue
			}
			into[doc.VM.Image] = append(into[doc.VM.Image], doc.ID)
		}
		return nil
	}
	if err := read(filepath.Join(home, "sandboxes", Name), sandboxes, false); err != nil {
		return nil, nil, err
	}
	if err := read(filepath.Join(home, "snapshots", Name), snapshots, true); err != nil {
		return nil, nil, err
	}
	return sandboxes, snapshots, nil
}

// Files in a sandbox's directory, besides hostkeep's.
const (
	qemuLogFile = "qemu.log"
	consoleFile = "console.log"
	lockFile    = "snapshot.lock"
)

// meta is DIR/meta.json.
type meta struct {
	hostkeep.Meta
	VM vmConfig `json:"vm"`
}

// keeperInfo is DIR/keeper.json (hostkeep.KeeperFile).
type keeperInfo struct {
	Keeper proc.Identity `json:"keeper"`
	QEMU   proc.Identity `json:"qemu"`
}

// New opens the provider: it checks that QEMU, the kernel and its modules,
// and a static busybox and guest binary are there. The guest image and the
// accelerator wait for Prepare (the first Create), so that a command that
// boots nothing (exec, ls, rm, gc) does not pay for them.
func New(ctx context.Context, o Options) (*Provider, error) {
	exe, err := hostkeep.KeeperExe(Name, o.Home, o.Exe)
	if err != nil {
		return nil, err
	}
	o.Exe = exe
	if o.GuestBinary == "" {
		bin, err := sandboxbin.Path()
		if err != nil {
			return nil, err
		}
		o.GuestBinary = bin
	}
	if o.KernelDir == "" {
		o.KernelDir = os.Getenv(KernelEnv)
	}
	if o.Busybox == "" {
		o.Busybox = "/bin/busybox"
	}
	if o.MemMiB == 0 {
		o.MemMiB = DefaultMemMiB
	}
	for src, dst := range o.ReadOnlyBinds {
		if err := checkBindPath(dst); err != nil {
			return nil, err
		}
		if !filepath.IsAbs(src) {
			return nil, fmt.Errorf("read-only bind %s → %s: give the host directory as an absolute path", src, dst)
		}
	}
	if o.BootTimeout == 0 {
		o.BootTimeout = 3 * time.Minute
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	p := &Provider{o: o}
	p.sbs = &hostkeep.Sandboxes[meta, *meta, keeperInfo]{
		Provider: Name, Flag: " --provider " + Name, Dir: filepath.Join(o.Home, "sandboxes", Name), Prefix: "vm-", Now: o.Now,
		Procs: func(k keeperInfo) (proc.Identity, proc.Identity) { return k.Keeper, k.QEMU },
		Runs:  "QEMU", Lost: "keeper or QEMU",
		Info: p.info,
		// Besides its saved state, a sandbox builds on its read-only
		// disks where a shared store holds them (shareddisk.go).
		Uses: func(m meta) []string { return m.VM.diskManifests() },
	}
	p.snaps = &hostkeep.Snapshots[snapMeta, *snapMeta]{
		Provider: Name, Dir: filepath.Join(o.Home, "snapshots", Name), Prefix: "vms-", Now: o.Now,
		Info: snapMeta.info, BlobLock: filepath.Join(o.Home, "vmblobs.lock"), Bases: p.sbs.Manifests,
	}
	if p.images, err = image.Open(o.Home, image.DefaultIDBase); err != nil {
		return nil, err
	}
	if p.qemu, err = exec.LookPath(QEMU); err != nil {
		return nil, fmt.Errorf("microvm provider needs %s: install it with `apt-get install qemu-system-x86` (make deps-microvm does)", QEMU)
	}
	if p.kernel, err = FindKernel(o.KernelDir); err != nil {
		return nil, fmt.Errorf("microvm provider: %w", err)
	}
	if _, err := os.Stat(o.Busybox); err != nil {
		return nil, fmt.Errorf("microvm provider needs a static busybox at %s: install it with `apt-get install busybox-static`", o.Busybox)
	}
	p.Calls = hostkeep.NewCalls(p.sbs, p.snaps)
	for _, d := range []string{p.sbs.Dir, p.snaps.Dir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	// What the image needs is checked here (cheap); the image is built,
	// and the accelerator chosen, when a sandbox is first booted.
	for _, bin := range []string{o.Busybox, o.GuestBinary} {
		if err := checkStatic(bin); err != nil {
			return nil, fmt.Errorf("microvm provider: %w", err)
		}
	}
	switch o.Accel {
	case "", "kvm", "tcg":
	default:
		return nil, fmt.Errorf("microvm provider: accelerator %q: want kvm, tcg or empty (probe)", o.Accel)
	}
	if o.Blobs != "" {
		share, err := o.Share.WithDefaults()
		if err != nil {
			return nil, fmt.Errorf("microvm provider: %w", err)
		}
		// A save relies on a chunk already stored only when its copy is
		// recent (or its sandbox's published base keeps it): a
		// collection elsewhere may be deleting an older one.
		s3, err := blob.OpenS3(ctx, o.Blobs, blob.S3Options{CacheDir: filepath.Join(o.Home, "vmblob-cache"), ReuseWithin: share.Reuse})
		if err != nil {
			return nil, fmt.Errorf("microvm provider: %w", err)
		}
		if err := hostkeep.ShareBlobs(ctx, p.sbs, p.snaps, s3, o.Home, share); err != nil {
			s3.Close()
			return nil, fmt.Errorf("microvm provider: %w", err)
		}
		p.blobs, p.closeBlobs = s3, s3.Close
	} else {
		bs, err := blob.NewDir(p.blobDir())
		if err != nil {
			return nil, err
		}
		p.blobs = bs
	}
	// Saved states are stored cut by guest address (see save), so two
	// states of one VM share the pages that did not change.
	p.snaps.CAS = cas.New(p.blobs)
	return p, nil
}

// shared says whether the snapshots are in a store several nodes share
// (Options.Blobs).
func (p *Provider) shared() bool { return p.closeBlobs != nil }

func (p *Provider) blobDir() string { return filepath.Join(p.o.Home, "vmblobs") }

// CatState writes a snapshot's saved state (a cas manifest in the blob
// store at blobDir) to w: what `stasis microvm state` runs for QEMU's
// incoming migration, so that a fork streams its state out of the store
// instead of through a file.
func CatState(ctx context.Context, blobDir, manifest string, w io.Writer) error {
	bs, err := blob.NewDir(blobDir)
	if err != nil {
		return err
	}
	return cas.New(bs).CatFile(ctx, manifest, stateFile, w)
}

func (p *Provider) Name() string { return Name }

func (p *Provider) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{KeepsProcesses: true, SnapshotOutlivesSource: true, Users: true, Freeze: true}
}

// Prepare builds (or finds) the guest image and chooses the accelerator,
// once per Provider; Create does it first. Only commands that boot pay for
// it: hashing the image's inputs, and the KVM probe the first time on a
// machine.
func (p *Provider) Prepare(ctx context.Context) error {
	p.prepOnce.Do(func() {
		var err error
		if p.initramfs, err = Initramfs(filepath.Join(p.o.Home, "images"), p.kernel, p.o.Busybox, p.o.GuestBinary); err != nil {
			p.prepErr = fmt.Errorf("microvm provider: the guest image: %w", err)
			return
		}
		if p.o.Accel != "" {
			p.accel, p.accelWhy = p.o.Accel, "asked for"
		} else {
			// The answer is a fact about this machine, QEMU and kernel:
			// it is kept beside the kernel, for every state directory.
			p.accel, p.accelWhy = chooseAccel(ctx, filepath.Join(p.kernel.Dir, ".stasis-accel.json"), p.qemu, p.kernel, p.initramfs)
		}
		if p.accel == "tcg" {
			p.tscKHz = hostTSCKHz()
		}
	})
	return p.prepErr
}

// Accel says which accelerator the provider uses, and why (empty when
// Prepare failed).
func (p *Provider) Accel() (string, string) {
	_ = p.Prepare(context.Background())
	return p.accel, p.accelWhy
}

// Kernel is the guest kernel in use.
func (p *Provider) Kernel() Kernel { return p.kernel }

func (p *Provider) sbDir(id string) string { return p.sbs.Path(id) }

func what(id string) string { return "sandbox " + id }

func readMetaAt(dir string) (meta, error) {
	return hostkeep.ReadJSON[meta](filepath.Join(dir, hostkeep.MetaFile))
}

func (p *Provider) info(m meta, state sandbox.State) sandbox.Info {
	in := m.Info(Name, state)
	in.Image = m.VM.Image
	in.Descriptor, _ = json.Marshal(map[string]any{"id": m.ID, "dir": p.sbDir(m.ID), "port": m.VM.Port, "accel": m.VM.Accel})
	return in
}

func (p *Provider) client(m meta) *agent.Client {
	return agent.New(fmt.Sprintf("http://127.0.0.1:%d", m.VM.Port))
}

// freePort finds a loopback port no one listens on. QEMU binds it a moment
// later; a start that loses the race is retried with another port.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// baseVM is new VM id's config; Prepare has run.
func (p *Provider) baseVM(id string) vmConfig {
	c := vmConfig{QEMU: p.qemu, Kernel: p.kernel.Image, Initramfs: p.initramfs, MemMiB: p.o.MemMiB, Accel: p.accel, TSCKHz: p.tscKHz}
	c.Gateway, c.Pipe = p.gateway(id)
	return c
}

// ownGateways says whether every guest gets a gateway socket of its own
// (Options.GatewayDir and GatewayServer).
func (p *Provider) ownGateways() bool { return p.o.GatewayDir != "" && p.o.GatewayServer != nil }

// GatewaySocketName is the name of a guest's own gateway socket in its
// directory under Options.GatewayDir.
const GatewaySocketName = "gw.sock"

// gatewaySocket is sandbox id's own gateway socket on the host.
func (p *Provider) gatewaySocket(id string) string {
	return filepath.Join(p.o.GatewayDir, id, GatewaySocketName)
}

// gateway is the host socket sandbox id's GatewayAddr leads to, and the
// command QEMU runs per connection to join it (none without a socket).
func (p *Provider) gateway(id string) (string, []string) {
	if !p.ownGateways() {
		return "", nil
	}
	sock := p.gatewaySocket(id)
	return sock, []string{p.o.Exe, "microvm", "pipe", "--unix", sock}
}

// listenGateway makes sandbox m's own gateway socket (when the guests
// have their own), closed to all but the host's root, whose pipes QEMU
// starts, and hands it to Options.GatewayServer.
func (p *Provider) listenGateway(m meta) error {
	if !p.ownGateways() || m.VM.Gateway != p.gatewaySocket(m.ID) {
		return nil
	}
	dir := filepath.Dir(m.VM.Gateway)
	if err := os.MkdirAll(p.o.GatewayDir, 0o711); err != nil {
		return fmt.Errorf("gateway directory: %w", err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("gateway directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("gateway directory: %w", err)
	}
	if err := os.Remove(m.VM.Gateway); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("gateway socket: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: m.VM.Gateway, Net: "unix"})
	if err != nil {
		return fmt.Errorf("gateway socket: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(m.VM.Gateway, 0o600); err != nil {
		ln.Close()
		return fmt.Errorf("gateway socket: %w", err)
	}
	p.o.GatewayServer.ServeSandbox(m.ID, ln)
	return nil
}

// stopGateway stops serving sandbox id's own gateway socket and removes
// its directory.
func (p *Provider) stopGateway(id string) {
	if !p.ownGateways() || !hostkeep.ValidID(id, "vm-") {
		return
	}
	p.o.GatewayServer.StopSandbox(id)
	_ = os.RemoveAll(filepath.Dir(p.gatewaySocket(id)))
}

// ServeGateways listens again on the own gateway socket of every sandbox
// there is (after the host process that served them restarted).
func (p *Provider) ServeGateways(ctx context.Context) error {
	if !p.ownGateways() {
		return nil
	}
	return p.sbs.Each(p.listenGateway)
}

// Create boots a microVM and returns once its agent answers.
func (p *Provider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	if err := hostkeep.CheckSpec(spec, p.o.Now()); err != nil {
		return sandbox.Info{}, err
	}
	if err := p.Prepare(ctx); err != nil {
		return sandbox.Info{}, err
	}
	id := hostkeep.NewID("vm-")
	m := meta{Meta: hostkeep.Meta{ID: id, Labels: spec.Labels, Env: spec.Env, Created: p.o.Now().UTC(), Expiry: spec.Expiry.UTC()}, VM: p.baseVM(id)}
	if len(p.o.ReadOnlyBinds) > 0 {
		var err error
		if m.VM.Binds, err = bindDisks(ctx, filepath.Join(p.o.Home, "images"), p.o.ReadOnlyBinds); err != nil {
			return sandbox.Info{}, fmt.Errorf("create: %w", err)
		}
	}
	if spec.Image != "" {
		im, err := p.images.Resolve(ctx, spec.Image, nil)
		if errors.Is(err, image.ErrNotFound) {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrNotFound, "create", "", "%v", err)
		}
		if err != nil {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "%v", err)
		}
		if m.VM.Disk, err = RootImage(ctx, im, RootFS); err != nil {
			return sandbox.Info{}, fmt.Errorf("create: %w", err)
		}
		m.VM.Image = im.Digest
		if m.VM.DiskID, err = fileID(m.VM.Disk); err != nil {
			return sandbox.Info{}, fmt.Errorf("create: %w", err)
		}
		for _, kv := range im.Env {
			if k, v, ok := strings.Cut(kv, "="); ok && k == "PATH" {
				if _, set := spec.Env["PATH"]; !set {
					m.Env = maps.Clone(m.Env)
					if m.Env == nil {
						m.Env = map[string]string{}
					}
					m.Env["PATH"] = v
				}
			}
		}
	}
	ok := false
	defer func() {
		if !ok {
			_ = p.retire(m.ID)
		}
	}()
	if err := p.boot(ctx, &m, nil); err != nil {
		return sandbox.Info{}, fmt.Errorf("create %s: %w", what(m.ID), err)
	}
	if spec.Root != "" {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(tarDir(spec.Root, pw)) }()
		err := p.client(m).Upload(ctx, "/work", pr)
		pr.Close()
		if err != nil {
			return sandbox.Info{}, fmt.Errorf("create %s: seed the work tree from %s: %w", what(m.ID), spec.Root, err)
		}
	}
	for path, data := range spec.Files {
		if err := p.WriteFile(ctx, m.ID, path, data, 0o644); err != nil {
			return sandbox.Info{}, fmt.Errorf("create: write %s: %w", path, err)
		}
	}
	ok = true
	return p.info(m, sandbox.StateRunning), nil
}

// tarDir writes dir as a tar stream with the system tar (exact metadata).
func tarDir(dir string, w io.Writer) error {
	cmd := exec.Command("tar", "-C", dir, "-cf", "-", ".")
	var errb strings.Builder
	cmd.Stdout, cmd.Stderr = w, &errb
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("tar %s: %v: %s", dir, err, strings.TrimSpace(errb.String()))
	}
	return nil
}

// boot writes the sandbox's directory and metadata, starts its keeper (and
// so QEMU) and waits for the agent; a QEMU that could not take its port is
// started again on another. A fork's QEMU loads its saved state first:
// from its Incoming command, or (IncomingStream) from cat, which writes
// the state (see streamIncoming).
func (p *Provider) boot(ctx context.Context, m *meta, cat func(context.Context, io.Writer) error) error {
	dir := p.sbDir(m.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := p.listenGateway(*m); err != nil {
		return err
	}
	var err error
	for attempt := 0; attempt < 4; attempt++ {
		if m.VM.Port, err = freePort(); err != nil {
			return err
		}
		if err = p.sbs.Write(*m); err != nil {
			return err
		}
		_ = os.Remove(filepath.Join(dir, hostkeep.KeeperFile))
		if err = p.startKeeper(ctx, m.ID); err != nil {
			return err
		}
		if len(m.VM.Incoming) > 0 {
			if err = p.resumeIncoming(ctx, *m); err != nil {
				return err
			}
		}
		if m.VM.IncomingStream {
			err = p.streamIncoming(ctx, *m, cat)
		}
		if err == nil {
			if err = p.waitAgent(ctx, *m); err == nil {
				return nil
			}
		}
		b, _ := os.ReadFile(filepath.Join(dir, qemuLogFile))
		if !strings.Contains(string(b), "host forwarding rule") {
			return err
		}
		// The port was taken between freePort and QEMU: stop this keeper
		// and try another.
		if k, ok := hostkeep.KeeperAt[keeperInfo](dir); ok {
			killVM(k)
		}
		_ = os.Remove(filepath.Join(dir, qemuLogFile))
	}
	return err
}

// resumeIncoming waits for a fork's QEMU to load its saved state and lets
// the guest run: the state was saved from a stopped guest, and QEMU keeps
// such a guest stopped after loading it.
func (p *Provider) resumeIncoming(ctx context.Context, m meta) error {
	bctx, cancel := context.WithTimeout(ctx, p.o.BootTimeout)
	defer cancel()
	mon, err := monitor(bctx, qmpPath(m.ID))
	if err != nil {
		return err
	}
	defer mon.Close()
	return p.waitLoaded(bctx, mon, m, nil)
}

// stateStream is the writing of a saved state into QEMU (streamIncoming):
// done is closed when the writer has ended, err is then its outcome.
type stateStream struct {
	done chan struct{}
	err  error
}

// failed is the stream's error, said as the load's, once it has ended. A
// broken pipe is not one: QEMU closed its end, done with the stream (it
// reads it to the end) or failing (its status says why).
func (s *stateStream) failed() error {
	if s.err == nil || errors.Is(s.err, syscall.EPIPE) {
		return nil
	}
	return fmt.Errorf("stream the saved state: %w", s.err)
}

// waitLoaded polls QEMU's status until it has loaded its saved state,
// and lets the guest run. st, when not nil, is the writing of the state
// into QEMU (streamIncoming): a failure there is the load's, said before
// QEMU's own complaint about a stream cut short.
func (p *Provider) waitLoaded(bctx context.Context, mon *qmpConn, m meta, st *stateStream) error {
	dir := p.sbDir(m.ID)
	var streamDone <-chan struct{}
	if st != nil {
		streamDone = st.done
	}
	streamErr := func(err error) error {
		if st == nil {
			return err
		}
		// QEMU ends once the stream fails it: the writer is told of it
		// at once (its pipe is broken).
		select {
		case <-st.done:
			if serr := st.failed(); serr != nil {
				return serr
			}
		case <-bctx.Done():
		}
		return err
	}
	for {
		var status struct {
			Status string `json:"status"`
		}
		if err := qmpRun(mon, "query-status", nil, &status); err != nil {
			qlog, _ := os.ReadFile(filepath.Join(dir, qemuLogFile))
			return streamErr(fmt.Errorf("%w; QEMU said: %s", err, strings.TrimSpace(string(qlog))))
		}
		switch status.Status {
		case "running":
			return nil
		case "inmigrate", "prelaunch":
		case "paused", "postmigrate", "restore-vm":
			return qmpRun(mon, "cont", nil, nil)
		default:
			qlog, _ := os.ReadFile(filepath.Join(dir, qemuLogFile))
			return streamErr(fmt.Errorf("QEMU is %q after loading the saved state: %s", status.Status, strings.TrimSpace(string(qlog))))
		}
		select {
		case <-bctx.Done():
			return streamErr(fmt.Errorf("QEMU did not load the saved state within %s", p.o.BootTimeout))
		case <-streamDone:
			if err := st.failed(); err != nil {
				return err
			}
			streamDone = nil // all written; QEMU may still be loading it
		case <-time.After(10 * time.Millisecond): // poll interval, bounded by the boot timeout
		}
	}
}

// streamIncoming has a fork's QEMU, started with -incoming defer, load
// its saved state from a pipe that this process writes: cat writes the
// state into it, out of the provider's own store (a shared one's read
// cache, each chunk verified), while waitLoaded watches QEMU. A chunk
// that fails its check, or a store that does not answer, fails the load
// with that error; QEMU, its stream cut short, exits.
func (p *Provider) streamIncoming(ctx context.Context, m meta, cat func(context.Context, io.Writer) error) error {
	if cat == nil {
		return errors.New("no saved state to stream") // a programming error
	}
	bctx, cancel := context.WithTimeout(ctx, p.o.BootTimeout)
	defer cancel()
	mon, err := monitor(bctx, qmpPath(m.ID))
	if err != nil {
		return err
	}
	defer mon.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	var closeW sync.Once
	closeWriter := func() { closeW.Do(func() { w.Close() }) }
	defer closeWriter()
	// A larger pipe wakes QEMU and the writer less often; the default
	// does if the kernel refuses.
	_, _ = unix.FcntlInt(w.Fd(), unix.F_SETPIPE_SZ, 1<<20)
	err = qmpRunFD(mon, "getfd", map[string]any{"fdname": "state"}, nil, r)
	r.Close() // QEMU has its own copy
	if err != nil {
		return err
	}
	if err := qmpRun(mon, "migrate-incoming", map[string]any{"uri": "fd:state"}, nil); err != nil {
		return err
	}
	st := &stateStream{done: make(chan struct{})}
	go func() {
		bw := bufio.NewWriterSize(w, 1<<20)
		err := cat(bctx, bw)
		if err == nil {
			err = bw.Flush()
		}
		closeWriter()
		st.err = err
		close(st.done)
	}()
	if err := p.waitLoaded(bctx, mon, m, st); err != nil {
		closeWriter() // a writer still blocked on the pipe returns
		return err
	}
	// Loaded: the writer has written it all (QEMU read up to the end),
	// or is told now that QEMU closed its end.
	select {
	case <-st.done:
		return st.failed()
	case <-bctx.Done():
		return fmt.Errorf("the saved state's stream did not end within %s of QEMU loading it", p.o.BootTimeout)
	}
}

// startKeeper starts the keeper, detached, and waits until it reports QEMU
// started.
func (p *Provider) startKeeper(ctx context.Context, id string) error {
	cmd := exec.Command(p.o.Exe, "microvm", "keeper", "--dir", p.sbDir(id))
	cmd.Env = append(os.Environ(), p.o.ExeEnv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	return p.sbs.StartKeeper(ctx, id, cmd)
}

// waitAgent polls the guest agent until it answers, QEMU dies, or the boot
// timeout passes; the error quotes QEMU's log and the console's tail.
func (p *Provider) waitAgent(ctx context.Context, m meta) error {
	dir := p.sbDir(m.ID)
	c := p.client(m)
	defer c.CloseIdle()
	deadline := time.Now().Add(p.o.BootTimeout)
	for {
		hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := c.Health(hctx)
		cancel()
		if err == nil {
			return nil
		}
		k, ok := hostkeep.KeeperAt[keeperInfo](dir)
		dead := ok && (!proc.Alive(k.QEMU) || !proc.Alive(k.Keeper))
		if dead || time.Now().After(deadline) || ctx.Err() != nil {
			why := "did not answer within " + p.o.BootTimeout.String()
			if dead {
				why = "QEMU exited"
			}
			if ctx.Err() != nil {
				why = ctx.Err().Error()
			}
			qlog, _ := os.ReadFile(filepath.Join(dir, qemuLogFile))
			return fmt.Errorf("the guest agent %s (%v); QEMU said: %s; console ends: %s", why, err, strings.TrimSpace(string(qlog)), tail(filepath.Join(dir, consoleFile), 600))
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond): // poll interval, bounded by the deadline above
		}
	}
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	s := strings.TrimSpace(string(b))
	if len(s) > n {
		s = "…" + s[len(s)-n:]
	}
	return s
}

// Delete retires a sandbox: kills its QEMU and removes its directory.
// Deleting a sandbox that is already gone returns nil.
func (p *Provider) Delete(ctx context.Context, id string) error {
	if !hostkeep.ValidID(id, "vm-") {
		return sandbox.Errorf(errdefs.ErrNotFound, "delete", what(id), "not a microvm sandbox id")
	}
	return p.retire(id)
}

// retire kills and removes a sandbox exactly once.
func (p *Provider) retire(id string) error {
	defer p.stopGateway(id)
	return p.sbs.Retire(id, func(dead string) { killAt(dead, id) })
}

// killAt ends the QEMU and keeper of sandbox id, whose directory is dir
// (if its keeper is known), and removes its QMP socket.
func killAt(dir, id string) {
	if k, ok := hostkeep.KeeperAt[keeperInfo](dir); ok {
		killVM(k)
	}
	_ = os.Remove(qmpPath(id))
}

// killVM ends QEMU and the keeper and waits until both are gone.
func killVM(k keeperInfo) { hostkeep.KillAndWait(k.QEMU, k.Keeper) }

// GC removes sandboxes whose keeper is gone (killed, the host restarted,
// or it ended at the expiry), ending a QEMU that outlived its keeper, and
// returns their ids. (Saved states are never written to files of their
// own: a snapshot streams into the blob store, whose staging a new
// blob.Dir clears, and a fork streams out of it.)
//
// It also lets run again each machine a snapshot stopped and whose
// snapshotter died before it let it go on (the process that took the
// snapshot was killed mid-save): its guest would answer nothing, and the
// recovery of the interrupted checkpoint, which continues the episode
// through the guest's agent, would wait for it forever.
//
// And it removes the QMP sockets in /tmp of machines that ended with no
// one to remove them (sweepQMP).
func (p *Provider) GC(ctx context.Context) ([]string, error) {
	reaped, err := p.sbs.GC(func(dead, id string) {
		killAt(dead, id)
		p.stopGateway(id)
	}, p.retire)
	if err != nil {
		return reaped, err
	}
	sweepQMP(time.Now())
	ms, err := p.sbs.All()
	if err != nil {
		return reaped, err
	}
	for _, m := range ms {
		if err := p.resumeStopped(ctx, m.ID); err != nil {
			slog.Warn("a machine an interrupted snapshot left stopped could not be let run again", "sandbox", m.ID, "err", err)
		}
	}
	return reaped, nil
}

// resumeStopped lets sandbox id's machine run again if a snapshot
// stopped it and nobody snapshots it now (its snapshot lock is free: the
// snapshotter died). A machine not running, or busy, is left alone.
func (p *Provider) resumeStopped(ctx context.Context, id string) error {
	if _, _, err := p.sbs.Live("gc", id); err != nil {
		return nil // not running: nothing to let go on
	}
	unlock, err := flock.TryLock(filepath.Join(p.sbDir(id), lockFile))
	if errors.Is(err, flock.ErrHeld) {
		return nil // a snapshot under way stops and continues it itself
	}
	if err != nil {
		return err
	}
	defer unlock()
	mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	mon, err := monitor(mctx, qmpPath(id))
	cancel()
	if err != nil {
		return err
	}
	defer mon.Close()
	var status struct {
		Status string `json:"status"`
	}
	if err := qmpRun(mon, "query-status", nil, &status); err != nil {
		return err
	}
	switch status.Status {
	case "paused", "postmigrate":
		if err := qmpRun(mon, "migrate_cancel", nil, nil); err != nil {
			return err
		}
		slog.Warn("a machine an interrupted snapshot left stopped runs again", "sandbox", id, "was", status.Status)
		return qmpRun(mon, "cont", nil, nil)
	}
	return nil
}

// Exec runs a command in the guest through its agent.
func (p *Provider) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if len(req.Argv) == 0 {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", what(id), "no command")
	}
	m, _, err := p.sbs.Live("exec", id)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	env := map[string]string{}
	for k, v := range m.Env {
		env[k] = v
	}
	for k, v := range req.Env {
		env[k] = v
	}
	req.Env = env
	c := p.client(m)
	defer c.CloseIdle()
	res, err := c.Exec(ctx, req)
	return res, p.wrap("exec", m, err)
}

// wrap names the sandbox in an agent error, and turns a failure to reach
// the agent of a sandbox that has meanwhile expired or died into that.
func (p *Provider) wrap(op string, m meta, err error) error {
	if err == nil {
		return nil
	}
	var se *sandbox.Error
	if errors.As(err, &se) {
		e := *se
		e.Op, e.What = op, what(m.ID)
		return &e
	}
	if _, _, err2 := p.sbs.Live(op, m.ID); err2 != nil {
		return err2
	}
	return fmt.Errorf("%s in %s: %w", op, what(m.ID), err)
}

// ReadFile reads a file in the guest.
func (p *Provider) ReadFile(ctx context.Context, id, path string) ([]byte, error) {
	m, _, err := p.sbs.Live("read", id)
	if err != nil {
		return nil, err
	}
	c := p.client(m)
	defer c.CloseIdle()
	b, err := c.ReadFile(ctx, path)
	return b, p.wrap("read", m, err)
}

// WriteFile writes a file in the guest.
func (p *Provider) WriteFile(ctx context.Context, id, path string, data []byte, mode fs.FileMode) error {
	m, _, err := p.sbs.Live("write", id)
	if err != nil {
		return err
	}
	c := p.client(m)
	defer c.CloseIdle()
	return p.wrap("write", m, c.WriteFile(ctx, path, data, mode))
}

// Upload extracts a tar stream into dir in the guest.
func (p *Provider) Upload(ctx context.Context, id, dir string, r io.Reader) error {
	m, _, err := p.sbs.Live("upload", id)
	if err != nil {
		return err
	}
	c := p.client(m)
	defer c.CloseIdle()
	return p.wrap("upload", m, c.Upload(ctx, dir, r))
}

// Download writes dir in the guest to w as a tar stream.
func (p *Provider) Download(ctx context.Context, id, dir string, w io.Writer) error {
	m, _, err := p.sbs.Live("download", id)
	if err != nil {
		return err
	}
	c := p.client(m)
	defer c.CloseIdle()
	return p.wrap("download", m, c.Download(ctx, dir, w))
}

// SetClock sets the guest's wall clock to t (the clock policy after a
// restore), computed by the guest agent from the guest's own uptime.
func (p *Provider) SetClock(ctx context.Context, id string, t guestclock.Target) (guestclock.Fix, error) {
	m, _, err := p.sbs.Live("set-clock", id)
	if err != nil {
		return guestclock.Fix{}, err
	}
	c := p.client(m)
	defer c.CloseIdle()
	f, err := c.SetClock(ctx, t)
	return f, p.wrap("set-clock", m, err)
}

// GuestInfo reports the guest's wall clock, uptime and boot id.
func (p *Provider) GuestInfo(ctx context.Context, id string) (agent.Info, error) {
	m, _, err := p.sbs.Live("info", id)
	if err != nil {
		return agent.Info{}, err
	}
	c := p.client(m)
	defer c.CloseIdle()
	in, err := c.Info(ctx)
	return in, p.wrap("info", m, err)
}

// Close is the contract's: it closes a shared blob store's connections
// and read cache; nothing else is this value's own (each guest's keeper
// and QEMU are processes of their own, and the gateway sockets are the
// GatewayServer's).
func (p *Provider) Close() error {
	if p.closeBlobs != nil {
		return p.closeBlobs()
	}
	return nil
}
