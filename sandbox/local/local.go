// Package local is the embedded default sandbox provider: namespaces on this
// host through bubblewrap, with file-only, content-addressed snapshots.
//
// Each sandbox is a directory under the state directory
// ($STASIS_HOME/sandboxes/local/ID) holding its metadata and its writable
// places (work → /work, home → $HOME, tmp → /tmp), and a keeper: a host
// process (`stasis sandbox keeper`, detached in its own session) that runs
// bubblewrap with its own PID, IPC, UTS, mount and network namespaces over a
// read-only view of the host root, and kills it all at the sandbox's
// absolute expiry. Exec enters the namespaces with nsenter and runs the
// command with no capabilities. When the keeper dies, bubblewrap dies with
// it (--die-with-parent), and with bubblewrap, as init of the PID namespace,
// every process in the sandbox.
//
// Snapshots store the writable places in a cas.Store over a directory blob
// store ($STASIS_HOME/blobs), deduplicated across snapshots and sandboxes;
// forks materialise from it.
package local

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"stasis/atomicfile"
	"stasis/blob"
	"stasis/cas"
	"stasis/errdefs"
	"stasis/image"
	"stasis/internal/sandboxbin"
	"stasis/proc"
	"stasis/sandbox"
	"stasis/sandbox/hostkeep"
)

// Name is the provider's name in records and on the command line.
const Name = "local"

// Options configure the provider.
type Options struct {
	// Home is the state directory ($STASIS_HOME).
	Home string
	// Exe is the stasis binary that runs keepers (default: this
	// executable); ExeEnv is extra environment for it (tests run their own
	// binary as stasis).
	Exe    string
	ExeEnv []string
	// Binds are host paths bound into every sandbox at the same path
	// (read-write). Nothing of stasis's own uses them any more: a
	// directory bound into several sandboxes lets one agent reach into
	// another's (GatewayDir gives each its own).
	Binds []string
	// GatewayDir, when set, gives every sandbox a directory of its own,
	// GatewayDir/ID (made with the sandbox, owned by its stasis user, mode
	// 0700, removed with it), bound read-only at GatewayDirInSandbox: the
	// host serves the gateway for that sandbox's episode on a socket there
	// (GatewaySocket), which the agent can neither reach nor replace.
	GatewayDir string
	// Gateway serves the gateway on each sandbox's own socket: the
	// provider listens at GatewaySocket(id) when it makes the sandbox
	// (Create, Fork), hands the listener to Gateway.ServeSandbox, and calls
	// StopSandbox when the sandbox goes. Needs GatewayDir.
	Gateway GatewayServer
	// System are host paths the sandboxes see read-only besides the
	// userland allow-list (bwrap.System): a toolchain under /opt, say.
	System []string
	// UIDBase is the first of the host ids the sandboxes' user namespaces
	// map (default DefaultUIDBase; see users.go).
	UIDBase int
	// Limits are the sandboxes' default limits (zero fields:
	// DefaultLimits); a spec's own override them (see limits.go).
	Limits sandbox.Limits
	// ReadOnlyBinds are host paths (keys) bound read-only into every
	// sandbox at other paths (values), e.g. a harness's installation. A
	// sandbox path must be absolute and outside /work, /tmp and $HOME; a
	// top-level one that the host lacks is made in the sandbox's root.
	ReadOnlyBinds map[string]string
	// Hide are more host paths that sandboxes must not see (an empty
	// directory is mounted over each), beside Home, which is always
	// hidden: a server's state directory, say.
	Hide []string
	// SandboxBinary is the static in-sandbox stasis (cmd/stasis-sandbox)
	// bound read-only at EnterBinary in a sandbox whose root is an image:
	// it becomes the exec's user there (internal/enter), where the host's
	// setpriv and env are not. Default: sandboxbin.Path(), looked up when
	// the first image sandbox is made.
	SandboxBinary string
	// ForkHook, when set, is called before each sandbox of a Fork is made,
	// with the snapshot and the sandbox's index; an error makes that one
	// fail (tests use it to prove a partial fork leaves nothing).
	ForkHook func(snapshot string, i int) error
	// Now is the clock (tests); time.Now when nil.
	Now func() time.Time
}

// Provider is the local provider.
type Provider struct {
	o       Options
	dir     string // sandboxes
	snapDir string // snapshot metadata
	cas     *cas.Store
	tools   struct{ bwrap, nsenter, setpriv, env string }
	mu      sync.Mutex // serialises this process's rewrites of meta.json

	images *image.Store

	retiredMu sync.Mutex
	retired   map[string]int
}

// Images is the provider's image store ($STASIS_HOME/images), whose
// images' owners are shifted to the sandboxes' user namespaces.
func (p *Provider) Images() *image.Store { return p.images }

// EnterBinary is where a sandbox whose root is an image sees
// Options.SandboxBinary.
const EnterBinary = "/stasis/enter/stasis"

// Retired says how many times this provider value retired sandbox id (for
// the conformance suite: a sandbox is retired exactly once).
func (p *Provider) Retired(id string) int {
	p.retiredMu.Lock()
	defer p.retiredMu.Unlock()
	return p.retired[id]
}

// New opens the local provider over the state directory, checking that
// bubblewrap and nsenter are installed.
func New(o Options) (*Provider, error) {
	if o.Home == "" {
		return nil, errors.New("local provider: no state directory")
	}
	if o.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		o.Exe = exe
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.UIDBase == 0 {
		o.UIDBase = DefaultUIDBase
	}
	if err := checkLimits(o.Limits); err != nil {
		return nil, fmt.Errorf("local provider: %w", err)
	}
	o.Limits = withDefaults(o.Limits, DefaultLimits)
	if o.UIDBase < IDRange || o.UIDBase > 1<<31 {
		return nil, fmt.Errorf("local provider: uid base %d: use a value from %d to %d (the sandboxes map %d host ids from it)", o.UIDBase, IDRange, 1<<31, IDRange)
	}
	p := &Provider{o: o, dir: filepath.Join(o.Home, "sandboxes", Name), snapDir: filepath.Join(o.Home, "snapshots", Name)}
	// Absolute paths: setpriv and env run after nsenter has changed root to
	// the sandbox's, which shows the host's /usr read-only.
	for _, t := range []struct {
		name, pkg string
		dst       *string
	}{{"bwrap", "bubblewrap", &p.tools.bwrap}, {"nsenter", "util-linux", &p.tools.nsenter}, {"setpriv", "util-linux", &p.tools.setpriv}, {"env", "coreutils", &p.tools.env}} {
		path, err := exec.LookPath(t.name)
		if err != nil {
			return nil, fmt.Errorf("local provider needs %s: install it with `apt-get install %s` (make installs it)", t.name, t.pkg)
		}
		if *t.dst, err = filepath.Abs(path); err != nil {
			return nil, err
		}
	}
	for _, d := range []string{p.dir, p.snapDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	bs, err := blob.NewDir(filepath.Join(o.Home, "blobs"))
	if err != nil {
		return nil, err
	}
	p.cas = cas.New(bs)
	if p.images, err = image.Open(o.Home, o.UIDBase); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *Provider) Name() string { return Name }

func (p *Provider) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{KeepsProcesses: false, SnapshotOutlivesSource: true, Users: true}
}

// meta is DIR/meta.json.
type meta struct {
	ID      string            `json:"id"`
	Labels  map[string]string `json:"labels,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Created time.Time         `json:"created"`
	Expiry  time.Time         `json:"expiry"`
	Source  string            `json:"source,omitempty"`
	// LastManifest is the cas manifest of the last snapshot (the base for
	// the next incremental snapshot).
	LastManifest string   `json:"last_manifest,omitempty"`
	Home         string   `json:"home"` // $HOME inside
	Hide         []string `json:"hide,omitempty"`
	Binds        []string `json:"binds,omitempty"`
	// ROBinds: host path → sandbox path, bound read-only.
	ROBinds map[string]string `json:"ro_binds,omitempty"`
	// UIDBase is the host id of the sandbox's uid and gid 0 (see
	// users.go); 0 in sandboxes made before user namespaces, which run as
	// the host's root and see every top-level entry of the host.
	UIDBase int `json:"uid_base,omitempty"`
	// System are host paths bound read-only besides bwrap.System.
	System []string `json:"system,omitempty"`
	// GatewayDir is the host directory bound read-only at
	// GatewayDirInSandbox: this sandbox's own, where the gateway's socket
	// for it is.
	GatewayDir string `json:"gateway_dir,omitempty"`
	// Image is the digest of the image whose root file system is the
	// sandbox's root (read-only); ImageRoot is where it is unpacked,
	// ImageEnv its config's environment and EnterBin the in-sandbox
	// binary bound at EnterBinary. Empty: the host's userland.
	Image     string   `json:"image,omitempty"`
	ImageRoot string   `json:"image_root,omitempty"`
	ImageEnv  []string `json:"image_env,omitempty"`
	EnterBin  string   `json:"enter_bin,omitempty"`
	// Limits are the sandbox's (every field set), enforced through
	// Cgroups and its keeper (limits.go); none in sandboxes made before
	// limits.
	Limits  sandbox.Limits `json:"limits,omitzero"`
	Cgroups cgroups        `json:"cgroups,omitzero"`
}

// Files in a sandbox's directory.
const (
	metaFile    = "meta.json"
	keeperFile  = "keeper.json" // the keeper's identity and the sandbox init's pid
	expiredFile = "expired"     // written by the keeper when it killed the sandbox at expiry
	logFile     = "keeper.log"
	rootDir     = "root" // writable places: root/work, root/home, root/tmp
)

// keeperInfo is DIR/keeper.json, written by the keeper once the sandbox runs.
type keeperInfo struct {
	Keeper proc.Identity `json:"keeper"`
	Init   proc.Identity `json:"init"`  // the sandbox's PID 1, as the host sees it
	Bwrap  proc.Identity `json:"bwrap"` // bubblewrap's outer process, the keeper's child
}

func (p *Provider) sbDir(id string) string { return filepath.Join(p.dir, id) }

func what(id string) string { return "sandbox " + id }

func (p *Provider) readMeta(op, id string) (meta, error) {
	var m meta
	if !hostkeep.ValidID(id, "sb-") {
		return m, sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "not a local sandbox id (sb- and 16 hex digits)")
	}
	b, err := os.ReadFile(filepath.Join(p.sbDir(id), metaFile))
	if errors.Is(err, os.ErrNotExist) {
		return m, sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "no such sandbox (deleted, or never made here); `stasis sandbox ls` lists them")
	}
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("%s %s: %s: %w", op, what(id), metaFile, err)
	}
	return m, nil
}

func (p *Provider) writeMeta(m meta) error {
	return atomicfile.WriteJSON(filepath.Join(p.sbDir(m.ID), metaFile), m, 0o600)
}

func (p *Provider) readKeeper(id string) (keeperInfo, bool) {
	var k keeperInfo
	b, err := os.ReadFile(filepath.Join(p.sbDir(id), keeperFile))
	if err != nil || json.Unmarshal(b, &k) != nil {
		return k, false
	}
	return k, true
}

func (p *Provider) info(m meta, state sandbox.State) sandbox.Info {
	desc, _ := json.Marshal(map[string]string{"id": m.ID, "dir": p.sbDir(m.ID)})
	return sandbox.Info{ID: m.ID, Provider: Name, State: state, Labels: m.Labels, Created: m.Created, Expiry: m.Expiry, Source: m.Source, Image: m.Image, Descriptor: desc}
}

// live checks that a sandbox exists, has not expired and its keeper runs.
func (p *Provider) live(op, id string) (meta, keeperInfo, error) {
	m, err := p.readMeta(op, id)
	if err != nil {
		return m, keeperInfo{}, err
	}
	k, err := p.running(op, m)
	return m, k, err
}

// running checks a sandbox whose metadata is read: not expired, keeper and
// init alive.
func (p *Provider) running(op string, m meta) (keeperInfo, error) {
	id := m.ID
	if _, err := os.Stat(filepath.Join(p.sbDir(id), expiredFile)); err == nil || !p.o.Now().Before(m.Expiry) {
		return keeperInfo{}, sandbox.Errorf(errdefs.ErrExpired, op, what(id), "it expired at %s; delete it or run `stasis sandbox gc`", m.Expiry.Format(time.RFC3339))
	}
	if r, ended := p.endedByLimit(id); ended {
		return keeperInfo{}, sandbox.Errorf(errdefs.ErrConflict, op, what(id), "it was ended at %s for exceeding its %s limit: %s; delete it", r.At.Format(time.RFC3339), r.Limit, r.Reason)
	}
	k, ok := p.readKeeper(id)
	if !ok || !proc.Alive(k.Keeper) || !proc.Alive(k.Init) {
		return k, sandbox.Errorf(errdefs.ErrConflict, op, what(id), "its keeper is not running (killed, or the host restarted); `stasis sandbox gc` removes it")
	}
	return k, nil
}

// Create makes a sandbox and returns once it runs.
func (p *Provider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	if spec.Expiry.IsZero() || !spec.Expiry.After(p.o.Now()) {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "the expiry %s is not in the future", spec.Expiry.Format(time.RFC3339))
	}
	if spec.Root != "" {
		if fi, err := os.Stat(spec.Root); err != nil || !fi.IsDir() {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "seed directory %q is not a directory", spec.Root)
		}
	}
	if err := checkLimits(spec.Limits); err != nil {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "%v", err)
	}
	m := p.newMeta(spec.Labels, spec.Expiry)
	m.Env = spec.Env
	m.Limits = withDefaults(spec.Limits, p.o.Limits)
	if spec.Image != "" {
		if err := p.useImage(ctx, &m, spec.Image); err != nil {
			return sandbox.Info{}, err
		}
	}
	dir := p.sbDir(m.ID)
	ok := false
	defer func() {
		if !ok {
			_ = p.retire(m.ID)
		}
	}()
	for _, d := range []string{"work", "home", "tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, rootDir, d), 0o755); err != nil {
			return sandbox.Info{}, err
		}
	}
	if err := os.Chmod(filepath.Join(dir, rootDir, "tmp"), os.ModeSticky|0o777); err != nil {
		return sandbox.Info{}, err
	}
	if spec.Root != "" {
		if err := copyTree(ctx, spec.Root, filepath.Join(dir, rootDir, "work")); err != nil {
			return sandbox.Info{}, fmt.Errorf("create: seed the work tree from %s: %w", spec.Root, err)
		}
	}
	if err := p.prepareDir(&m); err != nil {
		return sandbox.Info{}, fmt.Errorf("create: %w", err)
	}
	if err := p.writeMeta(m); err != nil {
		return sandbox.Info{}, err
	}
	if err := p.startKeeper(ctx, m.ID); err != nil {
		return sandbox.Info{}, err
	}
	for path, data := range spec.Files {
		if err := p.WriteFile(ctx, m.ID, path, data, 0o644); err != nil {
			return sandbox.Info{}, fmt.Errorf("create: write %s: %w", path, err)
		}
	}
	ok = true
	return p.info(m, sandbox.StateRunning), nil
}

// useImage makes an image the root of the sandbox m will describe:
// resolved (pulled and unpacked when its digest is not in the store yet)
// and the in-sandbox binary found.
func (p *Provider) useImage(ctx context.Context, m *meta, ref string) error {
	im, err := p.images.Resolve(ctx, ref, nil)
	if err != nil {
		if errors.Is(err, image.ErrNotFound) {
			return sandbox.Errorf(errdefs.ErrNotFound, "create", "", "%v", err)
		}
		return sandbox.Errorf(errdefs.ErrInvalid, "create", "", "%v", err)
	}
	bin := p.o.SandboxBinary
	if bin == "" {
		if bin, err = sandboxbin.Path(); err != nil {
			return fmt.Errorf("create: a sandbox with an image needs the in-sandbox binary: %w", err)
		}
	}
	m.Image, m.ImageRoot, m.ImageEnv, m.EnterBin = im.Digest, im.Root, im.Env, bin
	return nil
}

func (p *Provider) newMeta(labels map[string]string, expiry time.Time) meta {
	home := os.Getenv("HOME")
	if home == "" || home == "/" {
		home = "/root"
	}
	m := meta{ID: hostkeep.NewID("sb-"), Labels: labels, Created: p.o.Now().UTC(), Expiry: expiry.UTC(), Home: home, Binds: p.o.Binds, ROBinds: p.o.ReadOnlyBinds,
		UIDBase: p.o.UIDBase, System: p.o.System}
	if p.o.GatewayDir != "" {
		m.GatewayDir = filepath.Join(p.o.GatewayDir, m.ID)
	}
	// Hide the state directory from the sandbox when the read-only view of
	// the host root would show it.
	m.Hide = append([]string{p.o.Home}, p.o.Hide...)
	return m
}

// prepareDir gives a sandbox directory's writable places to the users of
// its namespace, makes its control groups (m.Cgroups) and its gateway
// directory.
func (p *Provider) prepareDir(m *meta) error {
	if err := ownPlaces(filepath.Join(p.sbDir(m.ID), rootDir), *m); err != nil {
		return err
	}
	if m.UIDBase != 0 {
		cg, err := makeCgroups(m.ID, m.Limits)
		if err != nil {
			return fmt.Errorf("limits: %w", err)
		}
		m.Cgroups = cg
	}
	if m.GatewayDir == "" {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(m.GatewayDir), 0o711); err != nil {
		return fmt.Errorf("gateway directory: %w", err)
	}
	if err := os.Mkdir(m.GatewayDir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("gateway directory: %w", err)
	}
	if m.UIDBase != 0 {
		if err := os.Lchown(m.GatewayDir, m.hostID(sandbox.ControlUID), m.hostID(sandbox.ControlUID)); err != nil {
			return fmt.Errorf("gateway directory: %w", err)
		}
	}
	if err := os.Chmod(m.GatewayDir, 0o700); err != nil {
		return fmt.Errorf("gateway directory: %w", err)
	}
	return p.listenGateway(*m)
}

// GatewayServer serves the gateway to one sandbox at a time on the
// sandbox's own socket (sandbox.GatewayServer).
type GatewayServer = sandbox.GatewayServer

// listenGateway makes sandbox m's gateway socket, closed to all but the
// sandbox's stasis user (uid 0 inside: the relay's), and hands it to
// Options.Gateway.
func (p *Provider) listenGateway(m meta) error {
	sock, ok := p.GatewaySocket(m.ID)
	if !ok || p.o.Gateway == nil {
		return nil
	}
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("gateway socket: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return fmt.Errorf("gateway socket: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	err = os.Chmod(sock, 0o600)
	if err == nil && m.UIDBase != 0 {
		err = os.Lchown(sock, m.hostID(sandbox.ControlUID), m.hostID(sandbox.ControlUID))
	}
	if err != nil {
		ln.Close()
		return fmt.Errorf("gateway socket: %w", err)
	}
	p.o.Gateway.ServeSandbox(m.ID, ln)
	return nil
}

// ServeGateways listens again on the gateway socket of every sandbox there
// is (after the host process that served them restarted).
func (p *Provider) ServeGateways(ctx context.Context) error {
	if p.o.Gateway == nil || p.o.GatewayDir == "" {
		return nil
	}
	infos, err := p.List(ctx, nil)
	if err != nil {
		return err
	}
	for _, in := range infos {
		m, err := p.readMeta("serve the gateway", in.ID)
		if err != nil || m.GatewayDir == "" {
			continue // gone since, or made without a socket of its own
		}
		if err := p.listenGateway(m); err != nil {
			return fmt.Errorf("sandbox %s: %w", in.ID, err)
		}
	}
	return nil
}

// GatewayDirInSandbox is where a sandbox sees its gateway directory
// (Options.GatewayDir), read-only, and GatewaySocketName the socket the
// host serves there.
const (
	GatewayDirInSandbox = "/stasis/gateway"
	GatewaySocketName   = "gw.sock"
)

// GatewaySocket is the host path of the socket on which the host serves
// the gateway to sandbox id (GatewayDirInSandbox/GatewaySocketName inside);
// false when the provider has no GatewayDir.
func (p *Provider) GatewaySocket(id string) (string, bool) {
	if p.o.GatewayDir == "" || !hostkeep.ValidID(id, "sb-") {
		return "", false
	}
	return filepath.Join(p.o.GatewayDir, id, GatewaySocketName), true
}

// copyTree seeds a work tree with cp -a (exact metadata, fast).
func copyTree(ctx context.Context, src, dst string) error {
	out, err := exec.CommandContext(ctx, "cp", "-a", "--", src+"/.", dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("cp -a: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// startKeeper starts the keeper, detached, and waits until it reports the
// sandbox running.
func (p *Provider) startKeeper(ctx context.Context, id string) error {
	dir := p.sbDir(id)
	logf, err := os.OpenFile(filepath.Join(dir, logFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(p.o.Exe, "sandbox", "keeper", "--dir", dir)
	cmd.Env = append(os.Environ(), p.o.ExeEnv...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// A mount namespace of its own (private, which Go makes it), where the
	// keeper stages the sandbox's binds; the host's mounts are not touched.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Unshareflags: syscall.CLONE_NEWNS}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the keeper of %s: %w", id, err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }() // reaps the keeper if it dies early; later it is init's
	deadline := time.Now().Add(30 * time.Second)
	for {
		if k, ok := p.readKeeper(id); ok && k.Keeper.PID == cmd.Process.Pid {
			// Detach: the keeper now belongs to no one here. Its wait
			// goroutine stays until the keeper ends.
			return nil
		}
		select {
		case err := <-waited:
			b, _ := os.ReadFile(filepath.Join(dir, logFile))
			return fmt.Errorf("the keeper of %s exited before the sandbox ran (%v): %s", id, err, strings.TrimSpace(string(b)))
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			return ctx.Err()
		default:
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			return fmt.Errorf("the keeper of %s did not start the sandbox within 30s; see %s", id, filepath.Join(dir, logFile))
		}
		nap(200 * time.Microsecond) // poll interval, bounded by the deadline above
	}
}

func nap(d time.Duration) {
	ts := unix.NsecToTimespec(d.Nanoseconds())
	_ = unix.Nanosleep(&ts, nil)
}

// Get finds a sandbox by id.
func (p *Provider) Get(ctx context.Context, id string) (sandbox.Info, error) {
	m, _, err := p.live("get", id)
	if errors.Is(err, errdefs.ErrExpired) {
		return p.info(m, sandbox.StateExpired), err
	}
	if err != nil {
		return sandbox.Info{}, err
	}
	return p.info(m, sandbox.StateRunning), nil
}

// List returns the sandboxes that carry every label given, expired ones
// included (with State "expired").
func (p *Provider) List(ctx context.Context, labels map[string]string) ([]sandbox.Info, error) {
	ents, err := os.ReadDir(p.dir)
	if err != nil {
		return nil, err
	}
	var out []sandbox.Info
	for _, e := range ents {
		if !hostkeep.ValidID(e.Name(), "sb-") {
			continue
		}
		m, err := p.readMeta("list", e.Name())
		if err != nil {
			continue
		}
		if !hostkeep.MatchLabels(m.Labels, labels) {
			continue
		}
		state := sandbox.StateRunning
		if _, err := p.running("list", m); err != nil {
			state = sandbox.StateExpired
			if errors.Is(err, errdefs.ErrConflict) {
				state = sandbox.StateLost
			}
		}
		out = append(out, p.info(m, state))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

// SetExpiry moves the sandbox's absolute expiry; the keeper re-reads it.
func (p *Provider) SetExpiry(ctx context.Context, id string, t time.Time) error {
	m, k, err := p.live("set-expiry", id)
	if err != nil {
		return err
	}
	if !t.After(p.o.Now()) {
		return sandbox.Errorf(errdefs.ErrInvalid, "set-expiry", what(id), "the expiry %s is not in the future; delete the sandbox instead", t.Format(time.RFC3339))
	}
	m.Expiry = t.UTC()
	if err := p.writeMeta(m); err != nil {
		return err
	}
	return unix.Kill(k.Keeper.PID, unix.SIGHUP)
}

// Delete retires a sandbox: kills everything in it and removes its
// directory. Deleting a sandbox that is already gone returns nil.
func (p *Provider) Delete(ctx context.Context, id string) error {
	if !hostkeep.ValidID(id, "sb-") {
		return sandbox.Errorf(errdefs.ErrNotFound, "delete", what(id), "not a local sandbox id")
	}
	return p.retire(id)
}

// retire kills and removes a sandbox exactly once.
func (p *Provider) retire(id string) error {
	done, err := hostkeep.Retire(p.sbDir(id), id, func(dead string) { killAt(dead) })
	if gw, ok := p.GatewaySocket(id); ok && err == nil {
		if p.o.Gateway != nil {
			p.o.Gateway.StopSandbox(id)
		}
		_ = os.RemoveAll(filepath.Dir(gw))
	}
	if done {
		p.retiredMu.Lock()
		if p.retired == nil {
			p.retired = map[string]int{}
		}
		p.retired[id]++
		p.retiredMu.Unlock()
	}
	return err
}

func readKeeperAt(dir string) (keeperInfo, bool) {
	var k keeperInfo
	b, err := os.ReadFile(filepath.Join(dir, keeperFile))
	if err != nil || json.Unmarshal(b, &k) != nil {
		return k, false
	}
	return k, true
}

// killSandbox ends the keeper, bubblewrap and the sandbox's init (and so
// every process in its PID namespace), and waits until they are gone.
func killSandbox(k keeperInfo) { hostkeep.KillAndWait(k.Init, k.Bwrap, k.Keeper) }

// killAt kills the sandbox whose directory is dir, if its keeper is known,
// and removes its control groups; it says whether a keeper was known.
func killAt(dir string) bool {
	k, ok := readKeeperAt(dir)
	if ok {
		killSandbox(k)
	}
	if m, err := readMetaAt(dir); err == nil {
		removeCgroups(m.Cgroups)
	}
	return ok
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// GC removes sandboxes whose keeper is gone (it was killed, the host
// restarted, or it ended at the expiry) and returns their ids.
func (p *Provider) GC(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(p.dir)
	if err != nil {
		return nil, err
	}
	var reaped []string
	for _, e := range ents {
		name := e.Name()
		if _, ok := hostkeep.RetiringID(name, "sb-"); ok {
			// An interrupted delete: finish it.
			killAt(filepath.Join(p.dir, name))
			_ = os.RemoveAll(filepath.Join(p.dir, name))
			continue
		}
		if !hostkeep.ValidID(name, "sb-") {
			continue
		}
		k, ok := p.readKeeper(name)
		if ok && proc.Alive(k.Keeper) {
			continue
		}
		if !ok {
			// No keeper.json: a create in progress, or one that died before
			// the sandbox ran. Leave young ones alone.
			fi, err := os.Stat(filepath.Join(p.dir, name))
			if err != nil || time.Since(fi.ModTime()) < time.Minute {
				continue
			}
		}
		if err := p.retire(name); err != nil {
			return reaped, err
		}
		reaped = append(reaped, name)
	}
	return reaped, nil
}

// ImageUsers returns, for each image digest, the sandboxes (every one
// there is, running or not) and the snapshots (not deleted) made on it.
func (p *Provider) ImageUsers(ctx context.Context) (sandboxes, snapshots map[string][]string, err error) {
	sandboxes, snapshots = map[string][]string{}, map[string][]string{}
	ents, err := os.ReadDir(p.dir)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range ents {
		if !hostkeep.ValidID(e.Name(), "sb-") {
			continue
		}
		if m, err := p.readMeta("list", e.Name()); err == nil && m.Image != "" {
			sandboxes[m.Image] = append(sandboxes[m.Image], m.ID)
		}
	}
	snaps, err := os.ReadDir(p.snapDir)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range snaps {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		if s, err := p.readSnap("list", id); err == nil && s.Image != "" {
			snapshots[s.Image] = append(snapshots[s.Image], s.ID)
		}
	}
	return sandboxes, snapshots, nil
}

// Close is the contract's: this value holds nothing of its own (each
// sandbox's keeper is a process of its own, and the gateway sockets are
// the GatewayServer's), so there is nothing to release.
func (p *Provider) Close() error { return nil }
