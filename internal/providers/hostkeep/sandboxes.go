package hostkeep

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/flock"
	"stasis/internal/proc"
	"stasis/internal/storage/atomicfile"
	"stasis/sandbox"
)

// Files in a sandbox's directory that every host provider has.
const (
	MetaFile    = "meta.json"
	MetaLock    = "meta.lock"   // held (flock) while meta.json is written
	KeeperFile  = "keeper.json" // written by the keeper once the sandbox runs
	ExpiredFile = "expired"     // written by the keeper when it killed the sandbox at expiry
	LogFile     = "keeper.log"
)

// Meta is what every sandbox's meta.json holds. A provider's own meta
// embeds it, so that its fields stand in the same JSON object.
type Meta struct {
	ID      string            `json:"id"`
	Labels  map[string]string `json:"labels,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Created time.Time         `json:"created"`
	Expiry  time.Time         `json:"expiry"`
	Source  string            `json:"source,omitempty"`
	// LastManifest is the cas manifest of the sandbox's last snapshot (or
	// of the one it was forked from): the base of its next snapshot, which
	// the blob store keeps.
	LastManifest string `json:"last_manifest,omitempty"`
}

func (m *Meta) meta() *Meta { return m }

// Info is the part of a sandbox.Info that m holds.
func (m Meta) Info(provider string, state sandbox.State) sandbox.Info {
	return sandbox.Info{ID: m.ID, Provider: provider, State: state, Labels: m.Labels, Created: m.Created, Expiry: m.Expiry, Source: m.Source}
}

// MetaOf is a provider's meta type M, as its pointer PM: one that embeds
// Meta.
type MetaOf[M any] interface {
	*M
	meta() *Meta
}

// Sandboxes are one provider's sandbox directories, Dir/ID, each with its
// meta.json (M) and the keeper.json (K) its keeper writes: reading them,
// rewriting meta.json under the sandbox's lock, telling whether a sandbox
// runs, and what Get, List, SetExpiry and GC do with that. The fields say
// what differs between providers; set them before use.
type Sandboxes[M any, PM MetaOf[M], K any] struct {
	Provider string // in messages: "not a local sandbox id"
	// Flag names the provider on the commands that messages suggest: ""
	// for the default provider, " --provider microvm".
	Flag   string
	Dir    string
	Prefix string // of ids: "sb-"
	Now    func() time.Time
	// Procs are the keeper's process and the sandbox's main one (local:
	// its init; microvm: QEMU), by keeper.json; the sandbox runs while
	// both live.
	Procs func(K) (keeper, main proc.Identity)
	// Runs names what the keeper starts ("the sandbox", "QEMU") and Lost
	// what must live for the sandbox to run ("keeper", "keeper or QEMU"),
	// in messages.
	Runs, Lost string
	// Ended, when set, says why a sandbox that has not expired was ended
	// nonetheless (local: a limit exceeded), or nil.
	Ended func(op string, m M) error
	// Info describes a sandbox (Meta.Info and what the provider adds).
	Info func(m M, state sandbox.State) sandbox.Info

	// Uses, when set, are the manifests a sandbox needs in the blob store
	// besides its LastManifest, by its meta.json (microvm: its read-only
	// disks stored in a shared store): kept, and published with its base,
	// while the sandbox is there (Bases).
	Uses func(M) []string

	// Pins, set by ShareBlobs when the blob store is shared, publish each
	// sandbox's base for every node's collection.
	Pins *Pins

	retiredMu sync.Mutex
	retired   map[string]int
}

// ReadJSON reads the JSON document at path into a T.
func ReadJSON[T any](path string) (T, error) {
	var v T
	b, err := os.ReadFile(path)
	if err != nil {
		return v, err
	}
	return v, json.Unmarshal(b, &v)
}

// KeeperAt reads the keeper.json of sandbox directory dir, if the keeper
// has written one.
func KeeperAt[K any](dir string) (K, bool) {
	k, err := ReadJSON[K](filepath.Join(dir, KeeperFile))
	return k, err == nil
}

// Path is sandbox id's directory.
func (s *Sandboxes[M, PM, K]) Path(id string) string { return filepath.Join(s.Dir, id) }

func what(id string) string { return "sandbox " + id }

func (s *Sandboxes[M, PM, K]) checkID(op, id string) error {
	if !ValidID(id, s.Prefix) {
		return sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "not a %s sandbox id (%s and 16 hex digits)", s.Provider, s.Prefix)
	}
	return nil
}

func (s *Sandboxes[M, PM, K]) notFound(op, id string) error {
	return sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "no such sandbox (deleted, or never made here); `stasis sandbox ls%s` lists them", s.Flag)
}

// Read reads sandbox id's meta.json; a sandbox that is not there is
// errdefs.ErrNotFound.
func (s *Sandboxes[M, PM, K]) Read(op, id string) (M, error) {
	var m M
	if err := s.checkID(op, id); err != nil {
		return m, err
	}
	m, err := ReadJSON[M](filepath.Join(s.Path(id), MetaFile))
	if errors.Is(err, os.ErrNotExist) {
		return m, s.notFound(op, id)
	}
	if err != nil {
		return m, fmt.Errorf("%s %s: %s: %w", op, what(id), MetaFile, err)
	}
	return m, nil
}

// lock takes sandbox id's meta lock (flock on MetaLock in its directory):
// every write of meta.json holds it, so that a read, change and write by
// one goroutine or process loses no other's change.
func (s *Sandboxes[M, PM, K]) lock(op, id string) (func(), error) {
	if err := s.checkID(op, id); err != nil {
		return nil, err
	}
	unlock, err := flock.Lock(filepath.Join(s.Path(id), MetaLock), true)
	if errors.Is(err, os.ErrNotExist) {
		return nil, s.notFound(op, id)
	}
	return unlock, err
}

func (s *Sandboxes[M, PM, K]) write(m M) error {
	return atomicfile.WriteJSON(filepath.Join(s.Path(PM(&m).meta().ID), MetaFile), m, 0o600)
}

// Write writes meta.json of sandbox m (whose directory is made), under
// its lock: for a sandbox being made, whose meta.json no one else changes
// yet.
func (s *Sandboxes[M, PM, K]) Write(m M) error {
	unlock, err := s.lock("write", PM(&m).meta().ID)
	if err != nil {
		return err
	}
	defer unlock()
	return s.write(m)
}

// Rewrite reads sandbox id's meta.json, lets change change it and writes
// it, all under its lock, and returns what it wrote. When change fails,
// nothing is written and its error is returned.
func (s *Sandboxes[M, PM, K]) Rewrite(op, id string, change func(PM) error) (M, error) {
	var m M
	unlock, err := s.lock(op, id)
	if err != nil {
		return m, err
	}
	defer unlock()
	if m, err = s.Read(op, id); err != nil {
		return m, err
	}
	if err := change(&m); err != nil {
		return m, err
	}
	return m, s.write(m)
}

// Bases are the manifests sandbox m builds on, by its meta.json: its
// LastManifest and what Uses says.
func (s *Sandboxes[M, PM, K]) Bases(m M) []string {
	var out []string
	if b := PM(&m).meta().LastManifest; b != "" {
		out = append(out, b)
	}
	if s.Uses != nil {
		for _, u := range s.Uses(m) {
			if u != "" {
				out = append(out, u)
			}
		}
	}
	return out
}

// SetBase records manifest as sandbox id's incremental base (after a
// snapshot of it), as Rebase does.
func (s *Sandboxes[M, PM, K]) SetBase(id, manifest string) error {
	return s.Rebase(id, func(m PM) { m.meta().LastManifest = manifest })
}

// Rebase changes what sandbox id builds on (after a snapshot of it):
// change sets its LastManifest and what Uses reads, under its lock; a
// sandbox gone or unreadable by now is left as it is. With Pins, the new
// bases are published beside the old ones before meta.json names them,
// and alone after.
func (s *Sandboxes[M, PM, K]) Rebase(id string, change func(PM)) error {
	unlock, err := s.lock("snapshot", id)
	if err != nil {
		return nil
	}
	defer unlock()
	m, err := s.Read("snapshot", id)
	if err != nil {
		return nil
	}
	ctx := context.Background()
	old := s.Bases(m)
	change(&m)
	now := s.Bases(m)
	if err := s.Pin(ctx, id, append(old, now...)...); err != nil {
		return err
	}
	if err := s.write(m); err != nil {
		return err
	}
	if err := s.Pin(ctx, id, now...); err != nil {
		// The old base stays published too: it costs blobs, not safety.
		slog.Warn("publishing a sandbox's new base alone failed; its old base stays kept too", "sandbox", id, "err", err)
	}
	return nil
}

// Running checks that a sandbox whose meta.json is read runs: it has not
// expired, was not ended (Ended), and its keeper and main process live.
// It returns the keeper's record.
func (s *Sandboxes[M, PM, K]) Running(op string, m M) (K, error) {
	var k K
	b := PM(&m).meta()
	if _, err := os.Stat(filepath.Join(s.Path(b.ID), ExpiredFile)); err == nil || !s.Now().Before(b.Expiry) {
		return k, sandbox.Errorf(errdefs.ErrExpired, op, what(b.ID), "it expired at %s; delete it or run `stasis sandbox gc%s`", b.Expiry.Format(time.RFC3339), s.Flag)
	}
	if s.Ended != nil {
		if err := s.Ended(op, m); err != nil {
			return k, err
		}
	}
	k, ok := KeeperAt[K](s.Path(b.ID))
	if ok {
		keeper, main := s.Procs(k)
		ok = proc.Alive(keeper) && proc.Alive(main)
	}
	if !ok {
		return k, sandbox.Errorf(errdefs.ErrConflict, op, what(b.ID), "its %s is not running (killed, or the host restarted); `stasis sandbox gc%s` removes it", s.Lost, s.Flag)
	}
	return k, nil
}

// Live reads sandbox id's meta.json and checks that it runs (Running).
func (s *Sandboxes[M, PM, K]) Live(op, id string) (M, K, error) {
	m, err := s.Read(op, id)
	if err != nil {
		var k K
		return m, k, err
	}
	k, err := s.Running(op, m)
	return m, k, err
}

// All reads the meta.json of every sandbox there is (running or not), in
// the directory's order; one that cannot be read is left out.
func (s *Sandboxes[M, PM, K]) All() ([]M, error) {
	ents, err := os.ReadDir(s.Dir)
	if err != nil {
		return nil, err
	}
	var out []M
	for _, e := range ents {
		if !ValidID(e.Name(), s.Prefix) {
			continue
		}
		if m, err := s.Read("list", e.Name()); err == nil {
			out = append(out, m)
		}
	}
	return out, nil
}

// Each calls f on every sandbox there is (All), stopping at its first
// error, which names the sandbox.
func (s *Sandboxes[M, PM, K]) Each(f func(M) error) error {
	ms, err := s.All()
	if err != nil {
		return err
	}
	for _, m := range ms {
		if err := f(m); err != nil {
			return fmt.Errorf("%s: %w", what(PM(&m).meta().ID), err)
		}
	}
	return nil
}

// Manifests are the bases (Bases: the incremental base, LastManifest, and
// what Uses adds) of every sandbox directory, a retiring one's too: what
// the blob store must keep for the sandboxes.
func (s *Sandboxes[M, PM, K]) Manifests() ([]string, error) {
	ents, err := os.ReadDir(s.Dir)
	if err != nil {
		return nil, err
	}
	var live []string
	for _, e := range ents {
		m, err := ReadJSON[M](filepath.Join(s.Dir, e.Name(), MetaFile))
		if err == nil {
			live = append(live, s.Bases(m)...)
		}
	}
	return live, nil
}

// Retire kills and removes sandbox id exactly once (see Retire), kill
// ending its processes in the directory renamed aside; gone is nil.
func (s *Sandboxes[M, PM, K]) Retire(id string, kill func(dead string)) error {
	done, err := Retire(s.Path(id), id, kill)
	if err == nil {
		s.unpin(id)
	}
	if done {
		s.retiredMu.Lock()
		if s.retired == nil {
			s.retired = map[string]int{}
		}
		s.retired[id]++
		s.retiredMu.Unlock()
	}
	return err
}

// unpin removes retired sandbox id's pin, if the store is shared; a pin
// left behind is removed by the next Reconcile.
func (s *Sandboxes[M, PM, K]) unpin(id string) {
	if s.Pins == nil {
		return
	}
	if err := s.Pins.Drop(context.Background(), id); err != nil {
		slog.Warn("removing a retired sandbox's published base failed; the next collection here removes it", "sandbox", id, "err", err)
	}
}

// GC retires (with retire) the sandboxes whose keeper is gone: it was
// killed, the host restarted, or it ended at the expiry. A directory
// without keeper.json is left alone for a minute (a create in progress).
// A delete that a crash interrupted is finished: finish ends what runs of
// the directory Retire renamed aside, which is then removed. It returns
// the ids retired.
func (s *Sandboxes[M, PM, K]) GC(finish func(dead, id string), retire func(id string) error) ([]string, error) {
	ents, err := os.ReadDir(s.Dir)
	if err != nil {
		return nil, err
	}
	var reaped []string
	for _, e := range ents {
		name := e.Name()
		if id, ok := RetiringID(name, s.Prefix); ok {
			finish(filepath.Join(s.Dir, name), id)
			if os.RemoveAll(filepath.Join(s.Dir, name)) == nil {
				s.unpin(id)
			}
			continue
		}
		if !ValidID(name, s.Prefix) {
			continue
		}
		k, ok := KeeperAt[K](s.Path(name))
		if ok {
			if keeper, _ := s.Procs(k); proc.Alive(keeper) {
				continue
			}
		} else {
			fi, err := os.Stat(s.Path(name))
			if err != nil || time.Since(fi.ModTime()) < time.Minute {
				continue
			}
		}
		if err := retire(name); err != nil {
			return reaped, err
		}
		reaped = append(reaped, name)
	}
	return reaped, nil
}

// StartKeeper starts cmd, sandbox id's keeper, detached, its output to
// the sandbox's LogFile, and waits until the keeper has written its
// keeper.json, for at most 30 seconds.
func (s *Sandboxes[M, PM, K]) StartKeeper(ctx context.Context, id string, cmd *exec.Cmd) error {
	dir := s.Path(id)
	logPath := filepath.Join(dir, LogFile)
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the keeper of %s: %w", id, err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }() // reaps the keeper if it dies early; later it is init's
	deadline := time.Now().Add(30 * time.Second)
	for {
		if k, ok := KeeperAt[K](dir); ok {
			if keeper, _ := s.Procs(k); keeper.PID == cmd.Process.Pid {
				// Detach: the keeper now belongs to no one here. Its
				// wait goroutine stays until the keeper ends.
				return nil
			}
		}
		select {
		case err := <-waited:
			b, _ := os.ReadFile(logPath)
			return fmt.Errorf("the keeper of %s exited before %s ran (%v): %s", id, s.Runs, err, strings.TrimSpace(string(b)))
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			return ctx.Err()
		case <-time.After(200 * time.Microsecond): // poll interval, bounded by the deadline below
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			return fmt.Errorf("the keeper of %s did not start %s within 30s; see %s", id, s.Runs, logPath)
		}
	}
}

// KeeperExe checks that a provider was given its state directory (home)
// and returns the stasis binary that runs its keepers: exe, or this
// executable when exe is empty.
func KeeperExe(provider, home, exe string) (string, error) {
	if home == "" {
		return "", fmt.Errorf("%s provider: no state directory", provider)
	}
	if exe != "" {
		return exe, nil
	}
	return os.Executable()
}

// CheckSpec refuses a spec whose expiry is not after now or whose seed
// directory (Root) is not a directory.
func CheckSpec(spec sandbox.Spec, now time.Time) error {
	if spec.Expiry.IsZero() || !spec.Expiry.After(now) {
		return sandbox.Errorf(errdefs.ErrInvalid, "create", "", "the expiry %s is not in the future", spec.Expiry.Format(time.RFC3339))
	}
	if spec.Root != "" {
		if fi, err := os.Stat(spec.Root); err != nil || !fi.IsDir() {
			return sandbox.Errorf(errdefs.ErrInvalid, "create", "", "seed directory %q is not a directory", spec.Root)
		}
	}
	return nil
}
