package task

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"stasis/sandbox"
)

// A Go task's verify runs its tests with a fresh GOCACHE (VerifyEnv): the
// agent's cache is never read, since its entries could compile to other
// code than their sources. Built from nothing, the standard library's
// test dependencies take tens of seconds per verify; so a Verifier with a
// SeedDir keeps, per environment, the cache of one trusted run: a Go
// task's own test command on its unchanged work tree, in a sandbox of its
// own, where no agent ever ran. Every Go task of that environment shares
// it (the standard library's part, the bulk of it, is the same for all):
// each verify starts from a copy and builds only the task's packages and
// what the agent changed. Making a seed costs
// one cold build and a sandbox, which pays once a second Go verify comes
// in the environment: a verify makes it at the second Go verify there in
// this process (one verify alone never pays), and
// Seed makes it at once for a caller that knows more will come. The cache is
// content-addressed by Go (an entry is found by the hash of its inputs),
// so a seed that no longer matches (a new toolchain, an edited task) only
// makes the build slower, never different.

// isGoTask says whether t's tests are Go's.
func isGoTask(t *Task) bool {
	return t.Language == "go" || strings.Contains(t.TestCmd, "go test")
}

// seedPath is where the seed of environment env, which t shares with the
// other Go tasks there, is kept in dir. (A seed made by another task's run
// lacks t's own packages, which its verify builds; it is never wrong: the
// cache is content-addressed.)
func seedPath(dir string, _ *Task, env string) string {
	h := sha256.Sum256([]byte("go\x00" + env))
	return filepath.Join(dir, "go-build-"+hex.EncodeToString(h[:12])+".tar")
}

// Seed returns the file of t's Go build cache seed, making it first if
// need be (one run of t's tests on its unchanged work tree); "" when t is
// not a Go task, the Verifier keeps no seeds, or the seed could not be
// made (logged: its verifies are then slower, not wrong). Verify calls it;
// calling it before a task's episodes start gives them a seeded cache.
// Seeds of different tasks are made at once; one task's, once.
func (v *Verifier) Seed(ctx context.Context, t *Task) string { return v.goSeed(ctx, t, true) }

// goSeed is Seed; without always, a missing seed is made only from the
// task's second call on (its second verify).
func (v *Verifier) goSeed(ctx context.Context, t *Task, always bool) string {
	if v.SeedDir == "" || !isGoTask(t) || t.Env["GOCACHE"] != "" {
		return ""
	}
	env, err := t.Environment(ctx)
	if err != nil {
		return ""
	}
	path := seedPath(v.SeedDir, t, env.String())
	l := v.seedLock(path)
	l.Lock()
	defer l.Unlock()
	if fi, err := os.Stat(path); err == nil && fi.Mode().IsRegular() && fi.Size() > 0 {
		return path
	}
	v.mu.Lock()
	if v.seedAsks == nil {
		v.seedAsks = map[string]int{}
	}
	v.seedAsks[path]++
	first := v.seedAsks[path] == 1
	v.mu.Unlock()
	if first && !always {
		return ""
	}
	start := time.Now()
	if err := v.makeSeed(ctx, t, path); err != nil {
		slog.Warn("no Go build cache seed for the task; its verifies build from an empty cache", "task", t.ID, "err", err)
		return ""
	}
	slog.Info("Go build cache seed made", "task", t.ID, "file", path, "seconds", time.Since(start).Seconds())
	return path
}

// seedLock is the lock of one seed file.
func (v *Verifier) seedLock(path string) *sync.Mutex {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.seedLocks == nil {
		v.seedLocks = map[string]*sync.Mutex{}
	}
	l, ok := v.seedLocks[path]
	if !ok {
		l = &sync.Mutex{}
		v.seedLocks[path] = l
	}
	return l
}

// ReadySeed returns t's Go build cache seed if one is made already (by an
// earlier verify), and "" otherwise; it builds nothing. An episode's
// sandbox starts with a copy of it in the agent's own cache: the agent
// builds faster, and what it does to its copy is never read by a verify.
func (v *Verifier) ReadySeed(ctx context.Context, t *Task) string {
	if v == nil || v.SeedDir == "" || !isGoTask(t) || t.Env["GOCACHE"] != "" {
		return ""
	}
	env, err := t.Environment(ctx)
	if err != nil {
		return ""
	}
	path := seedPath(v.SeedDir, t, env.String())
	if fi, err := os.Stat(path); err == nil && fi.Mode().IsRegular() && fi.Size() > 0 {
		return path
	}
	return ""
}

// SeedIn returns t's Go build cache seed, making it first, if need be, in
// the sandbox given, which must hold t's unchanged work tree with nothing
// of an agent run in it yet (an episode's, before its harness starts): the
// same trusted run as Seed's, without a sandbox of its own. "" when t is
// not a Go task or the Verifier keeps no seeds; an error when none could
// be made (the run failed, or left no cache): the caller goes on without.
func (v *Verifier) SeedIn(ctx context.Context, t *Task, id string) (string, error) {
	if v == nil || v.SeedDir == "" || !isGoTask(t) || t.Env["GOCACHE"] != "" {
		return "", nil
	}
	env, err := t.Environment(ctx)
	if err != nil {
		return "", err
	}
	path := seedPath(v.SeedDir, t, env.String())
	l := v.seedLock(path)
	l.Lock()
	defer l.Unlock()
	if fi, err := os.Stat(path); err == nil && fi.Mode().IsRegular() && fi.Size() > 0 {
		return path, nil
	}
	start := time.Now()
	if err := v.captureSeed(ctx, t, id, path); err != nil {
		return "", err
	}
	slog.Info("Go build cache seed made", "task", t.ID, "sandbox", id, "file", path, "seconds", time.Since(start).Seconds())
	return path, nil
}

// UploadSeed unpacks seed (a ReadySeed file) into dir in a sandbox.
func UploadSeed(ctx context.Context, p sandbox.Files, id, dir, seed string) error {
	return uploadFile(ctx, p, id, dir, seed)
}

// makeSeed runs t's tests on its unchanged work tree in a sandbox of its
// own and keeps the run's GOCACHE at path (written whole, then renamed).
func (v *Verifier) makeSeed(ctx context.Context, t *Task, path string) error {
	if err := os.MkdirAll(v.SeedDir, 0o700); err != nil {
		return err
	}
	tree, err := os.MkdirTemp("", "stasis-goseed-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tree)
	if err := t.Materialize(tree); err != nil {
		return err
	}
	info, err := v.Provider.Create(ctx, sandbox.Spec{
		Root: tree, Env: t.EnvMap(), Expiry: time.Now().Add(2*t.Budget() + 5*time.Minute),
		Labels: map[string]string{"stasis.task": t.ID, "stasis.role": "go-seed"},
	})
	if err != nil {
		return err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := v.Provider.Delete(dctx, info.ID); err != nil {
			slog.Warn("the Go seed run's sandbox could not be deleted", "task", t.ID, "sandbox", info.ID, "err", err)
		}
	}()
	return v.captureSeed(ctx, t, info.ID, path)
}

// captureSeed runs t's tests in sandbox id (which holds its unchanged work
// tree) and keeps the run's GOCACHE at path (written whole, then renamed).
func (v *Verifier) captureSeed(ctx context.Context, t *Task, id, path string) error {
	if err := os.MkdirAll(v.SeedDir, 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(v.SeedDir, ".go-build-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name()) // after the rename, nothing
	if _, err := runTests(ctx, v.Provider, id, t, runOptions{capture: f}); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if fi.Size() == 0 {
		return fmt.Errorf("the seed run's GOCACHE was empty")
	}
	return os.Rename(f.Name(), path)
}

// uploadFile unpacks the tar stream file into dir inside the sandbox.
func uploadFile(ctx context.Context, p sandbox.Files, id, dir, file string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	return p.Upload(ctx, id, dir, f)
}
