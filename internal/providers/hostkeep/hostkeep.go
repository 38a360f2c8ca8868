// Package hostkeep owns what the providers whose sandboxes run on this host
// (local, microvm) share: sandbox and snapshot ids, label matching, the
// keeper's loop (the absolute expiry, SIGHUP to re-read it, SIGTERM to
// stop), ending a sandbox's host processes and waiting for them, and
// retiring a sandbox directory exactly once; the sandbox directories
// (Sandboxes: meta.json, rewritten only under the sandbox's lock, and
// keeper.json; whether a sandbox runs; starting its keeper; GC) and the
// snapshot records and their blob store (Snapshots); on a blob store the
// providers of several nodes share (ShareBlobs), the sandboxes' published
// bases (Pins) and the collection that marks from every node's (see
// shared.go); and the calls of the provider contract that these answer
// alone (Calls: Get, List, SetExpiry, GetSnapshot, DeleteSnapshot,
// CollectBlobs, ForgetHome). A provider
// says what differs (its meta and keeper records, its processes, its
// messages) through type parameters and fields.
package hostkeep

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/proc"
	"stasis/internal/storage/atomicfile"
)

// NewID is prefix and 16 random lowercase hex digits.
func NewID(prefix string) string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// ValidID says whether id is prefix and 16 lowercase hex digits.
func ValidID(id, prefix string) bool {
	if !strings.HasPrefix(id, prefix) || len(id) != len(prefix)+16 {
		return false
	}
	_, err := hex.DecodeString(id[len(prefix):])
	return err == nil && strings.ToLower(id) == id
}

// MatchLabels says whether have carries every label of want.
func MatchLabels(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}

// KillAndWait sends SIGKILL to each live process of ids until none is
// left, for at most ten seconds.
func KillAndWait(ids ...proc.Identity) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		alive := false
		for _, id := range ids {
			if id.PID > 0 && proc.Alive(id) {
				alive = true
				_ = unix.Kill(id.PID, unix.SIGKILL)
			}
		}
		if !alive || time.Now().After(deadline) {
			return
		}
		ts := unix.NsecToTimespec(time.Millisecond.Nanoseconds())
		_ = unix.Nanosleep(&ts, nil) // poll interval, bounded by the deadline above
	}
}

// Signals are what a keeper listens to: SIGHUP (re-read the expiry),
// SIGTERM and SIGINT (stop). Call it before starting the sandbox, so that
// no signal is lost.
func Signals() chan os.Signal {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGTERM, syscall.SIGINT)
	return sigs
}

// Loop is a keeper's life once its sandbox runs: it kills the sandbox
// (kill, with the reason) at expiry, after writing expiredFile so that the
// host refuses the sandbox from then on; re-reads the expiry on SIGHUP;
// kills it on SIGTERM or SIGINT; and returns when the sandbox ends on its
// own (exited), with an error naming logPath.
func Loop(id string, expiry time.Time, readExpiry func() (time.Time, error), sigs <-chan os.Signal, exited <-chan error,
	kill func(reason string), expiredFile, logPath string, log *slog.Logger) error {
	for {
		timer := time.NewTimer(time.Until(expiry))
		select {
		case <-timer.C:
			_ = atomicfile.Write(expiredFile, []byte(time.Now().UTC().Format(time.RFC3339Nano)+"\n"), 0o600)
			kill("expired")
			return nil
		case s := <-sigs:
			timer.Stop()
			if s == syscall.SIGHUP {
				e, err := readExpiry()
				if err != nil {
					log.Warn("re-read the expiry", "err", err)
					continue
				}
				expiry = e
				log.Info("expiry changed", "id", id, "expiry", expiry)
				continue
			}
			kill("asked to stop")
			return nil
		case err := <-exited:
			timer.Stop()
			var ee *exec.ExitError
			if err == nil || errors.As(err, &ee) {
				return fmt.Errorf("the sandbox ended on its own (%v); see %s", err, logPath)
			}
			return err
		}
	}
}

// Retire renames a sandbox's directory aside (so that of two concurrent
// calls only one proceeds), calls kill on the renamed directory, and
// removes it. It returns false, and no error, when dir is already gone.
func Retire(dir, id string, kill func(dead string)) (bool, error) {
	dead := filepath.Join(filepath.Dir(dir), ".retiring-"+id+"-"+NewID(""))
	if err := os.Rename(dir, dead); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		return false, fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	kill(dead)
	if err := os.RemoveAll(dead); err != nil {
		return true, fmt.Errorf("delete sandbox %s: remove %s: %w", id, dead, err)
	}
	return true, nil
}

// Crash calls kill on every sandbox directory under dir (a missing dir
// has none) and counts those kill says it killed: what a provider's Crash
// does to the sandboxes a state directory holds.
func Crash(dir string, kill func(sandboxDir string) bool) (int, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range ents {
		if e.IsDir() && kill(filepath.Join(dir, e.Name())) {
			n++
		}
	}
	return n, nil
}

// RetiringID returns the sandbox id of a directory Retire renamed aside
// and a crash left there (".retiring-ID-…"), if name is one.
func RetiringID(name, prefix string) (string, bool) {
	rest, ok := strings.CutPrefix(name, ".retiring-")
	if !ok || len(rest) < len(prefix)+16 || !ValidID(rest[:len(prefix)+16], prefix) {
		return "", false
	}
	return rest[:len(prefix)+16], true
}
