package sandbox

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"

	"stasis/errdefs"
)

// Config is what a host gives the provider it opens by name. The host
// providers (local, microvm) take their state directory and the host's
// wiring from it; a hosted provider reads its service's address and key
// from the environment and uses none of it.
type Config struct {
	// Home is the provider's state directory on this host ($STASIS_HOME,
	// or a server's STATE/NAME).
	Home string
	// Exe is the stasis binary that runs keepers (default: this
	// executable); ExeEnv is extra environment for it.
	Exe    string
	ExeEnv []string
	// Binary is the host's stasis binary that a host provider's sandboxes
	// run their supervisor with, at BinaryPath: a local sandbox gets it
	// bound read-only, a microVM guest in its image (GuestBinary, when
	// set, instead: the guest needs a static one). Empty: none is put in.
	Binary      string
	GuestBinary string
	// SandboxBinary is the static in-sandbox stasis for image roots
	// (local).
	SandboxBinary string
	// GatewayDir and Gateway give every sandbox a gateway socket of its
	// own, served by Gateway (see GatewayServer); unset, the sandboxes
	// reach no gateway.
	GatewayDir string
	Gateway    GatewayServer
	// ReadOnlyBinds are host directories (keys) every sandbox sees
	// read-only at other paths (values).
	ReadOnlyBinds map[string]string
	// Hide are host paths no sandbox may see (local).
	Hide []string
	// Limits are the sandboxes' default limits (local).
	Limits Limits
	// MemMiB is each guest's memory (microvm; 0: its default).
	MemMiB int
	// Blobs, when set, is an S3 URL (s3://BUCKET/PREFIX) where the
	// provider keeps its snapshots, blobs and records, so that the
	// providers of several nodes on that store fork each other's
	// snapshots (those whose Driver.Blobs is true: local, microvm);
	// unset, they stay in Home.
	Blobs string
	// SnapshotHook, when set (tests: the kill matrix's step gate), is
	// called inside each Snapshot of a host provider while the snapshot
	// is being written, with the sandbox's id: local, once its data is
	// stored and before it is recorded as a snapshot; microvm, while
	// QEMU's migration of the machine runs. An error fails the snapshot.
	SnapshotHook func(sandbox string) error
}

// Driver is one kind of provider as the registry knows it.
type Driver struct {
	// Hosted: the sandboxes run in a service elsewhere, not on this host,
	// and reach the gateway over the network, not by a socket of the
	// host's.
	Hosted bool
	// GatewayURL is where a sandbox of a host provider reaches its own
	// gateway socket (a unix: or http: URL inside the sandbox); empty for
	// a hosted provider.
	GatewayURL string
	// NoFreeze says why the provider's sandboxes cannot freeze a held
	// harness, when its Capabilities.Freeze is false and it knows why.
	NoFreeze string
	// Blobs: the provider keeps its snapshots in Config.Blobs when it is
	// set (a host provider whose snapshots the nodes of a cluster share).
	Blobs bool
	// Open makes the provider from c.
	Open func(ctx context.Context, c Config) (Provider, error)
}

// HostedDriver is the Driver of a hosted service's provider, which
// fromEnv configures from the environment.
func HostedDriver[P Provider](fromEnv func() (P, error)) Driver {
	return Driver{
		Hosted: true,
		Open: func(context.Context, Config) (Provider, error) {
			p, err := fromEnv()
			if err != nil {
				return nil, err
			}
			return p, nil
		},
	}
}

var registry = struct {
	sync.RWMutex
	drivers map[string]Driver
}{drivers: map[string]Driver{}}

// Register makes a provider known by name; each provider's package
// registers itself (package stasis/internal/providers imports them all). A
// name registered twice is a programming error.
func Register(name string, d Driver) {
	registry.Lock()
	defer registry.Unlock()
	if _, ok := registry.drivers[name]; ok || d.Open == nil {
		panic("sandbox: provider " + name + " registered twice, or without Open")
	}
	registry.drivers[name] = d
}

// Names lists the registered providers, sorted.
func Names() []string {
	registry.RLock()
	defer registry.RUnlock()
	out := make([]string, 0, len(registry.drivers))
	for n := range registry.drivers {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Lookup returns the driver of a registered provider; an unknown name is
// errdefs.ErrInvalid, naming the known ones.
func Lookup(name string) (Driver, error) {
	registry.RLock()
	d, ok := registry.drivers[name]
	registry.RUnlock()
	if !ok {
		return Driver{}, errdefs.Errorf(errdefs.ErrInvalid, "provider %q: use %s", name, strings.Join(Names(), ", "))
	}
	return d, nil
}

// Open opens the named provider with c. Close it when done.
func Open(ctx context.Context, name string, c Config) (Provider, error) {
	d, err := Lookup(name)
	if err != nil {
		return nil, err
	}
	p, err := d.Open(ctx, c)
	if err != nil {
		return nil, fmt.Errorf("provider %s: %w", name, err)
	}
	return p, nil
}

// IsHosted reports whether name is a registered hosted provider.
func IsHosted(name string) bool {
	d, err := Lookup(name)
	return err == nil && d.Hosted
}

// KeepsBlobs says whether the named provider keeps its snapshots in
// Config.Blobs when it is set (Driver.Blobs).
func KeepsBlobs(name string) bool {
	d, err := Lookup(name)
	return err == nil && d.Blobs
}
