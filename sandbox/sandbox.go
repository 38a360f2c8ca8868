// Package sandbox owns the provider contract: the Provider interface every
// kind of sandbox implements (local namespaces, microVMs, hosted services),
// the Capabilities a provider reports, and the typed errors that the CLI and
// the HTTP layers turn into messages and status codes. The conformance suite
// every provider passes is in sandbox/sandboxtest.
package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"time"
)

// Capabilities says what a provider's sandboxes and snapshots can do.
type Capabilities struct {
	// KeepsProcesses: a snapshot keeps running processes (a memory image);
	// a fork continues them. False: file-only snapshots.
	KeepsProcesses bool `json:"keeps_processes"`
	// SnapshotOutlivesSource: a snapshot stays usable after its source
	// sandbox is deleted.
	SnapshotOutlivesSource bool `json:"snapshot_outlives_source"`
	// ConsumesSnapshotOnRestore: forking a snapshot uses it up.
	ConsumesSnapshotOnRestore bool `json:"consumes_snapshot_on_restore"`
	// MaxFork is the most sandboxes one Fork call may make (0: no limit).
	MaxFork int `json:"max_fork"`
	// Users: the provider runs an exec as the unprivileged agent user by
	// default (AgentUID) and as stasis's own user on request (UserControl,
	// ControlUID), and files written by the host belong to the agent. False:
	// every exec runs as one user, and the harness is not kept from stasis's
	// own files and sockets in the sandbox.
	Users bool `json:"users"`
	// Freeze: the sandbox has a writable cgroup v2 file system at
	// /sys/fs/cgroup for stasis's user, so the supervisor can freeze the
	// harness tree during a hold (pause mode hold+freeze).
	Freeze bool `json:"freeze"`
}

// NoFreezeReason says why a provider without Capabilities.Freeze cannot
// freeze a held harness.
func NoFreezeReason(name string) string {
	if d, err := Lookup(name); err == nil && d.NoFreeze != "" {
		return d.NoFreeze
	}
	return "the " + name + " provider's sandboxes give stasis no writable cgroup v2 file system it knows of"
}

// GatewayServer serves the gateway to each sandbox on a socket of the
// sandbox's own, which a provider makes on the host (local, microvm).
type GatewayServer interface {
	// ServeSandbox serves sandbox id's relays on ln (the provider's
	// listener, closed to everyone but what joins the sandbox to it) until
	// StopSandbox(id); a second call for the same id replaces the first.
	ServeSandbox(id string, ln net.Listener)
	// StopSandbox stops serving sandbox id and closes its listener.
	StopSandbox(id string)
}

// BinaryPath is where a host provider's sandboxes have the stasis binary
// (Config.Binary), read-only.
const BinaryPath = "/stasis/bin/stasis"

// User names whom an exec runs as inside a sandbox.
type User string

// The users inside a sandbox whose provider has Capabilities.Users.
const (
	// UserAgent, the default, is the unprivileged user the harness and
	// the task's code run as: it cannot read stasis's token, reach the
	// gateway, drive the supervisor, or trace or signal stasis's
	// processes.
	UserAgent User = ""
	// UserControl is stasis's own user: the supervisor, its relay and
	// `stasis ctl`. It owns the relay's credentials, the gateway's socket
	// and the supervisor's control socket. It is never the host's root.
	UserControl User = "control"
)

// The numeric ids of the users inside a sandbox (uid and gid alike).
const (
	ControlUID = 0
	AgentUID   = 1000
)

// Spec describes a sandbox to create.
type Spec struct {
	// Root is a host directory whose contents seed the sandbox's work tree
	// (/work); empty for an empty work tree.
	Root string `json:"root,omitempty"`
	// Image is the sandbox's root: an image reference (package image's
	// oci:, docker-archive:, docker:// or sha256: forms) on the local and
	// microvm providers, the service's template or image name on a hosted
	// one. Empty: the provider's default. Providers that have no images
	// refuse a non-empty Image with errdefs.ErrUnsupported.
	Image string `json:"image,omitempty"`
	// Files are written into the sandbox after it is made: absolute path
	// inside the sandbox → content.
	Files map[string][]byte `json:"-"`
	// Env is added to every exec's environment.
	Env    map[string]string `json:"env,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
	// Expiry is the absolute time at which the host kills the sandbox.
	Expiry time.Time `json:"expiry"`
	// Limits bound what the sandbox may use; zero fields take the
	// provider's defaults. Providers that cannot enforce them say so in
	// their documentation.
	Limits Limits `json:"limits,omitzero"`
}

// Limits bound a sandbox's use of the host. A sandbox that exceeds one is
// ended, with the reason, and the others go on.
type Limits struct {
	// Pids is the most processes and threads it may run at once.
	Pids int `json:"pids,omitempty"`
	// MemoryBytes is the most memory (and swap) it may use.
	MemoryBytes int64 `json:"memory_bytes,omitempty"`
	// CPUWeight is its share of the CPUs against the other sandboxes'
	// (cgroup v2's cpu.weight: 1 to 10000, 100 an even share).
	CPUWeight int `json:"cpu_weight,omitempty"`
	// ShmBytes is the size of its /dev/shm.
	ShmBytes int64 `json:"shm_bytes,omitempty"`
	// DiskBytes is the most its writable places may take on disk.
	DiskBytes int64 `json:"disk_bytes,omitempty"`
}

// Check refuses limits no sandbox could run under (zero fields are the
// provider's defaults).
func (l Limits) Check() error {
	switch {
	case l.Pids < 0 || l.MemoryBytes < 0 || l.ShmBytes < 0 || l.DiskBytes < 0 || l.CPUWeight < 0:
		return errors.New("limits must not be negative (0 takes the default)")
	case l.Pids != 0 && l.Pids < 16:
		return fmt.Errorf("pids limit %d: give at least 16 (stasis's own processes need some)", l.Pids)
	case l.MemoryBytes != 0 && l.MemoryBytes < 32<<20:
		return fmt.Errorf("memory limit %d bytes: give at least 32 MiB", l.MemoryBytes)
	case l.CPUWeight > 10000:
		return fmt.Errorf("cpu weight %d: give 1 to 10000 (100 is an even share)", l.CPUWeight)
	case l.ShmBytes != 0 && l.ShmBytes < 1<<20:
		return fmt.Errorf("/dev/shm size %d bytes: give at least 1 MiB", l.ShmBytes)
	case l.DiskBytes != 0 && l.DiskBytes < 1<<20:
		return fmt.Errorf("disk limit %d bytes: give at least 1 MiB", l.DiskBytes)
	}
	return nil
}

// State is a sandbox's state as Get and List report it.
type State string

// The sandbox states.
const (
	StateRunning State = "running"
	// StateExpired: its expiry passed; it is gone or going.
	StateExpired State = "expired"
	// StateLost: its host side (keeper, QEMU) died without retiring it;
	// GC removes it.
	StateLost State = "lost"
)

// Info describes one sandbox.
type Info struct {
	ID       string            `json:"id"`
	Provider string            `json:"provider"`
	State    State             `json:"state"`
	Labels   map[string]string `json:"labels,omitempty"`
	Created  time.Time         `json:"created"`
	Expiry   time.Time         `json:"expiry"`
	// Source is the snapshot the sandbox was forked from, if any.
	Source string `json:"source,omitempty"`
	// Image is what the sandbox's root is made of: an image digest
	// (sha256:HEX) on the local and microvm providers, the service's own
	// template or image name on a hosted one; empty for the provider's
	// default.
	Image string `json:"image,omitempty"`
	// Descriptor is what the provider needs to find the sandbox again
	// (recorded in checkpoints).
	Descriptor json.RawMessage `json:"descriptor,omitempty"`
}

// SnapshotInfo describes one snapshot.
type SnapshotInfo struct {
	ID       string    `json:"id"`
	Name     string    `json:"name,omitempty"`
	Sandbox  string    `json:"sandbox"`
	Provider string    `json:"provider"`
	Created  time.Time `json:"created"`
	// KeepsProcesses is true when this snapshot holds running processes.
	KeepsProcesses bool `json:"keeps_processes"`
	// Image is the digest of the image the snapshot's sandbox ran on
	// (local, microvm), which a fork needs.
	Image string `json:"image,omitempty"`
	// Bytes and NewBytes: the snapshot's logical size and what it added to
	// storage; zero when the provider cannot say.
	Bytes    int64 `json:"bytes,omitempty"`
	NewBytes int64 `json:"new_bytes,omitempty"`
}

// ExecRequest is one command to run in a sandbox.
type ExecRequest struct {
	Argv []string
	Env  map[string]string
	// Cwd inside the sandbox; the provider's work directory when empty.
	Cwd    string
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	// Timeout bounds a foreground command: it is killed when it passes and
	// Exec returns an error wrapping errdefs.ErrTimeout.
	Timeout time.Duration
	// Background: start the command and return at once; it runs until it
	// ends or the sandbox goes. Stdin, Stdout and Stderr are then ignored;
	// output goes to LogPath inside the sandbox when set (its directory is
	// made if missing).
	Background bool
	LogPath    string
	// User runs the command as UserControl instead of the agent (only on
	// providers with Capabilities.Users; others ignore it).
	User User
}

// ExecResult is the outcome of Exec.
type ExecResult struct {
	// ExitCode of a foreground command (minus the signal number when a
	// signal ended it).
	ExitCode int `json:"exit_code"`
	// PID of a background command, as the sandbox sees it.
	PID int `json:"pid,omitempty"`
}

// ForkSpec describes the sandboxes a fork makes.
type ForkSpec struct {
	Labels map[string]string
	Expiry time.Time
	// Limits of each fork; zero fields take the source sandbox's (when the
	// provider still knows them), else the provider's defaults.
	Limits Limits
}

// Provider creates, snapshots, forks and deletes sandboxes of one kind:
// the three parts of the contract below, which a caller names by the part
// it uses (the harness adapters and verify take Files alone).
//
// Every method that names a sandbox or a snapshot returns an error matching
// errdefs.ErrNotFound for one that does not exist or was deleted, and
// errdefs.ErrExpired for a sandbox past its expiry.
type Provider interface {
	Lifecycle
	Files
	Snapshots
}

// Lifecycle makes, finds and retires sandboxes, and is the provider's own
// life.
type Lifecycle interface {
	Name() string
	Capabilities() Capabilities

	Create(ctx context.Context, spec Spec) (Info, error)
	// Get finds a sandbox by id, also one made by an earlier process.
	Get(ctx context.Context, id string) (Info, error)
	// List returns the sandboxes carrying every given label.
	List(ctx context.Context, labels map[string]string) ([]Info, error)
	// Delete retires a sandbox and everything running in it. Deleting one
	// already gone returns nil.
	Delete(ctx context.Context, id string) error
	// SetExpiry moves the absolute expiry (earlier or later).
	SetExpiry(ctx context.Context, id string, t time.Time) error
	// GC removes the sandboxes that can no longer run (their host side
	// died, or their expiry passed while nobody watched) and returns
	// their ids.
	GC(ctx context.Context) ([]string, error)
	// Close releases what this value holds (connections, goroutines,
	// listeners). The sandboxes live on: another Provider of the same
	// configuration finds them.
	Close() error
}

// Files runs commands in a sandbox and moves files in and out.
type Files interface {
	Exec(ctx context.Context, id string, req ExecRequest) (ExecResult, error)
	ReadFile(ctx context.Context, id, path string) ([]byte, error)
	WriteFile(ctx context.Context, id, path string, data []byte, mode fs.FileMode) error
	// Upload extracts a tar stream into dir inside the sandbox.
	Upload(ctx context.Context, id, dir string, tar io.Reader) error
	// Download writes dir inside the sandbox to w as a tar stream.
	Download(ctx context.Context, id, dir string, w io.Writer) error
}

// Snapshots saves sandboxes and starts new ones from what was saved.
type Snapshots interface {
	// Snapshot saves the sandbox; name is optional. Snapshot ids are never
	// reused.
	Snapshot(ctx context.Context, id, name string) (SnapshotInfo, error)
	// Fork starts n sandboxes from a snapshot. All or nothing: if any fails,
	// every sandbox it made is deleted and the error says which failed.
	Fork(ctx context.Context, snapshot string, n int, spec ForkSpec) ([]Info, error)
	GetSnapshot(ctx context.Context, snapshot string) (SnapshotInfo, error)
	// DeleteSnapshot is idempotent, like Delete.
	DeleteSnapshot(ctx context.Context, snapshot string) error
	// CollectBlobs frees the stored snapshot data that no snapshot names
	// any more and returns how many blobs and bytes it freed; a provider
	// whose snapshots a service keeps returns zeros.
	CollectBlobs(ctx context.Context) (blobs int, bytes int64, err error)
}

// SnapshotsDeleter is a provider that deletes many snapshots at once,
// collecting what they held once rather than after each (deleting a
// checkpoint deletes a snapshot per episode). Like DeleteSnapshot it is
// idempotent; an error names the snapshots it could not delete, the
// others deleted all the same.
type SnapshotsDeleter interface {
	DeleteSnapshots(ctx context.Context, snapshots []string) error
}
