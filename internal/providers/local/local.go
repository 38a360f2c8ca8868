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
	"strings"
	"syscall"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/image"
	"stasis/internal/proc"
	"stasis/internal/providers/hostkeep"
	"stasis/internal/sandboxbin"
	"stasis/internal/storage/blob"
	"stasis/internal/storage/cas"
	"stasis/sandbox"
)

// Name is the provider's name in records and on the command line.
const Name = "local"

// Options configure the provider.
type Options struct {
	// Home is the state directory ($STASIS_HOME).
	Home string
	// Blobs, when set, is an S3 URL (s3://BUCKET/PREFIX, with the AWS
	// environment variables for its endpoint and credentials) where the
	// snapshots' blobs and records are kept instead of Home, shared by
	// the providers of every node on it: any of them forks any snapshot.
	// A bounded read cache stays in Home (blob-cache). The sandboxes'
	// incremental bases are published there too, so that a collection on
	// any node keeps them (hostkeep.ShareBlobs).
	Blobs string
	// Share tunes the collection of a shared Blobs store (zero fields:
	// hostkeep's defaults).
	Share hostkeep.ShareOptions
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
	// SnapshotHook, when set (tests), is called inside each Snapshot while
	// the snapshot is being written: its data (every chunk and the
	// manifest) is stored, and it is not yet recorded as a snapshot nor
	// the sandbox's base. An error fails the snapshot.
	SnapshotHook func(sandbox string) error
	// ForkHook, when set, is called before each sandbox of a Fork is made,
	// with the snapshot and the sandbox's index; an error makes that one
	// fail (tests use it to prove a partial fork leaves nothing).
	ForkHook func(snapshot string, i int) error
	// Now is the clock (tests); time.Now when nil.
	Now func() time.Time
}

// Provider is the local provider.
type Provider struct {
	o      Options
	tools  struct{ bwrap, nsenter, setpriv, env string }
	images *image.Store

	// The sandboxes ($STASIS_HOME/sandboxes/local) and the snapshots
	// ($STASIS_HOME/snapshots/local, their blobs in $STASIS_HOME/blobs),
	// kept as hostkeep keeps them; Calls answers Get, List, SetExpiry,
	// GetSnapshot, DeleteSnapshot and CollectBlobs from them alone.
	sbs   *hostkeep.Sandboxes[meta, *meta, keeperInfo]
	snaps *hostkeep.Snapshots[snapMeta, *snapMeta]
	hostkeep.Calls[meta, *meta, keeperInfo, snapMeta, *snapMeta]
	// closeBlobs closes a shared blob store (Options.Blobs), or is nil.
	closeBlobs func() error
}

// Images is the provider's image store ($STASIS_HOME/images), whose
// images' owners are shifted to the sandboxes' user namespaces.
func (p *Provider) Images() *image.Store { return p.images }

// EnterBinary is where a sandbox whose root is an image sees
// Options.SandboxBinary.
const EnterBinary = "/stasis/enter/stasis"

// New opens the local provider over the state directory, checking that
// bubblewrap and nsenter are installed.
func New(o Options) (*Provider, error) {
	exe, err := hostkeep.KeeperExe(Name, o.Home, o.Exe)
	if err != nil {
		return nil, err
	}
	o.Exe = exe
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
	p := &Provider{o: o}
	p.sbs = &hostkeep.Sandboxes[meta, *meta, keeperInfo]{
		Provider: Name, Dir: filepath.Join(o.Home, "sandboxes", Name), Prefix: "sb-", Now: o.Now,
		Procs: func(k keeperInfo) (proc.Identity, proc.Identity) { return k.Keeper, k.Init },
		Runs:  "the sandbox", Lost: "keeper",
		Ended: p.endedByLimit, Info: p.info,
	}
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
	p.snaps = &hostkeep.Snapshots[snapMeta, *snapMeta]{
		Provider: Name, Dir: filepath.Join(o.Home, "snapshots", Name), Prefix: "snap-", Now: o.Now,
		Info: snapMeta.info, BlobLock: filepath.Join(o.Home, "blobs.lock"), Bases: p.sbs.Manifests,
	}
	p.Calls = hostkeep.NewCalls(p.sbs, p.snaps)
	for _, d := range []string{p.sbs.Dir, p.snaps.Dir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	var bs blob.Store
	if o.Blobs != "" {
		share, err := o.Share.WithDefaults()
		if err != nil {
			return nil, fmt.Errorf("local provider: %w", err)
		}
		s3, err := blob.OpenS3(context.Background(), o.Blobs, blob.S3Options{CacheDir: filepath.Join(o.Home, "blob-cache"), ReuseWithin: share.Reuse})
		if err != nil {
			return nil, fmt.Errorf("local provider: %w", err)
		}
		if err := hostkeep.ShareBlobs(context.Background(), p.sbs, p.snaps, s3, o.Home, share); err != nil {
			s3.Close()
			return nil, fmt.Errorf("local provider: %w", err)
		}
		bs, p.closeBlobs = s3, s3.Close
	} else if bs, err = blob.NewDir(filepath.Join(o.Home, "blobs")); err != nil {
		return nil, err
	}
	p.snaps.CAS = cas.New(bs)
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
	hostkeep.Meta
	Home  string   `json:"home"` // $HOME inside
	Hide  []string `json:"hide,omitempty"`
	Binds []string `json:"binds,omitempty"`
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

// rootDir, in a sandbox's directory, holds its writable places:
// root/work, root/home, root/tmp. (The files beside it are
// hostkeep's.)
const rootDir = "root"

// keeperInfo is DIR/keeper.json (hostkeep.KeeperFile), written by the
// keeper once the sandbox runs.
type keeperInfo struct {
	Keeper proc.Identity `json:"keeper"`
	Init   proc.Identity `json:"init"`  // the sandbox's PID 1, as the host sees it
	Bwrap  proc.Identity `json:"bwrap"` // bubblewrap's outer process, the keeper's child
}

func (p *Provider) sbDir(id string) string { return p.sbs.Path(id) }

func what(id string) string { return "sandbox " + id }

func (p *Provider) info(m meta, state sandbox.State) sandbox.Info {
	in := m.Info(Name, state)
	in.Image = m.Image
	in.Descriptor, _ = json.Marshal(map[string]string{"id": m.ID, "dir": p.sbDir(m.ID)})
	return in
}

// Create makes a sandbox and returns once it runs.
func (p *Provider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	if err := hostkeep.CheckSpec(spec, p.o.Now()); err != nil {
		return sandbox.Info{}, err
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
	if err := p.sbs.Write(m); err != nil {
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
	m := meta{Meta: hostkeep.Meta{ID: hostkeep.NewID("sb-"), Labels: labels, Created: p.o.Now().UTC(), Expiry: expiry.UTC()},
		Home: home, Binds: p.o.Binds, ROBinds: p.o.ReadOnlyBinds, UIDBase: p.o.UIDBase, System: p.o.System}
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
	if !ok || p.o.Gateway == nil || m.GatewayDir == "" {
		return nil // no gateway, or a sandbox made without a socket of its own
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
	return p.sbs.Each(p.listenGateway)
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
	cmd := exec.Command(p.o.Exe, "sandbox", "keeper", "--dir", p.sbDir(id))
	cmd.Env = append(os.Environ(), p.o.ExeEnv...)
	// A mount namespace of its own (private, which Go makes it), where the
	// keeper stages the sandbox's binds; the host's mounts are not touched.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Unshareflags: syscall.CLONE_NEWNS}
	return p.sbs.StartKeeper(ctx, id, cmd)
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
	err := p.sbs.Retire(id, func(dead string) { killAt(dead) })
	if gw, ok := p.GatewaySocket(id); ok && err == nil {
		if p.o.Gateway != nil {
			p.o.Gateway.StopSandbox(id)
		}
		_ = os.RemoveAll(filepath.Dir(gw))
	}
	return err
}

// killSandbox ends the keeper, bubblewrap and the sandbox's init (and so
// every process in its PID namespace), and waits until they are gone.
func killSandbox(k keeperInfo) { hostkeep.KillAndWait(k.Init, k.Bwrap, k.Keeper) }

// killAt kills the sandbox whose directory is dir, if its keeper is known,
// and removes its control groups; it says whether a keeper was known.
func killAt(dir string) bool {
	k, ok := hostkeep.KeeperAt[keeperInfo](dir)
	if ok {
		killSandbox(k)
	}
	if m, err := readMetaAt(dir); err == nil {
		removeCgroups(m.Cgroups)
	}
	return ok
}

// GC removes sandboxes whose keeper is gone (it was killed, the host
// restarted, or it ended at the expiry) and returns their ids.
func (p *Provider) GC(ctx context.Context) ([]string, error) {
	return p.sbs.GC(func(dead, _ string) { killAt(dead) }, p.retire)
}

// ImageUsers returns, for each image digest, the sandboxes (every one
// there is, running or not) and the snapshots (not deleted) made on it.
func (p *Provider) ImageUsers(ctx context.Context) (sandboxes, snapshots map[string][]string, err error) {
	sandboxes, snapshots = map[string][]string{}, map[string][]string{}
	ms, err := p.sbs.All()
	if err != nil {
		return nil, nil, err
	}
	for _, m := range ms {
		if m.Image != "" {
			sandboxes[m.Image] = append(sandboxes[m.Image], m.ID)
		}
	}
	snaps, err := os.ReadDir(p.snaps.Dir)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range snaps {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		if s, err := p.snaps.Read("list", id); err == nil && s.Image != "" {
			snapshots[s.Image] = append(snapshots[s.Image], s.ID)
		}
	}
	return sandboxes, snapshots, nil
}

// Close is the contract's: it closes a shared blob store's connections;
// nothing else is this value's own (each sandbox's keeper is a process of
// its own, and the gateway sockets are the GatewayServer's).
func (p *Provider) Close() error {
	if p.closeBlobs != nil {
		return p.closeBlobs()
	}
	return nil
}
