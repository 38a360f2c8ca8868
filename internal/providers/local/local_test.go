package local_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/proc"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/sandbox"
	"stasis/sandbox/sandboxtest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// newProvider opens a local provider over a fresh state directory, run by
// this test binary acting as stasis.
func newProvider(t *testing.T, hook func(string, int) error) (*local.Provider, string) {
	t.Helper()
	home := t.TempDir()
	p, err := local.New(local.Options{Home: home, Exe: stasistest.Exe(), ExeEnv: stasistest.Env, ForkHook: hook})
	if err != nil {
		t.Fatal(err)
	}
	return p, home
}

// hostProcesses lists host processes whose command line or working
// directory mentions dir (keepers, bubblewrap, and anything in a sandbox,
// whose root and cwd sit below the state directory).
func hostProcesses(dir string) []int {
	all, _ := proc.All()
	var out []int
	for pid := range all {
		if pid == os.Getpid() {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		if strings.Contains(string(b), dir) {
			out = append(out, pid)
		}
	}
	return out
}

func TestConformance(t *testing.T) {
	var mu sync.Mutex
	fail := map[string]int{} // snapshot → index of the fork sandbox that fails
	p, home := newProvider(t, func(snapshot string, i int) error {
		mu.Lock()
		defer mu.Unlock()
		if k, ok := fail[snapshot]; ok && k == i {
			return errors.New("injected fork failure")
		}
		return nil
	})
	t.Run("suite", func(t *testing.T) {
		sandboxtest.Run(t, sandboxtest.Harness{
			Provider: p,
			FailFork: func(snapshot string, k int) func() {
				mu.Lock()
				fail[snapshot] = k
				mu.Unlock()
				return func() { mu.Lock(); delete(fail, snapshot); mu.Unlock() }
			},
			Retired: p.Retired,
			HostProcesses: func(id string) []int {
				return hostProcesses(filepath.Join(home, "sandboxes", "local", id))
			},
		})
	})
	// Nothing is left: no sandbox, no keeper, no bubblewrap, no mount.
	left, err := p.List(context.Background(), nil)
	if err != nil || len(left) != 0 {
		t.Errorf("sandboxes left after the suite: %+v %v", left, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(hostProcesses(home)) > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if pids := hostProcesses(home); len(pids) > 0 {
		t.Errorf("host processes left: %v", pids)
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mounts), home) {
		t.Errorf("mounts left under %s", home)
	}
	stasistest.NoChildrenLeft(t)
}

func TestIsolation(t *testing.T) {
	t.Parallel()
	p, home := newProvider(t, nil)
	ctx := context.Background()
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = p.Delete(ctx, info.ID) }()
	var out strings.Builder
	script := `
		echo pid1=$(cat /proc/1/comm)
		hostname
		tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' 
		touch /usr/stasis-escape 2>/dev/null && echo ROOT-WRITABLE || echo root-ro
		touch /work/w /tmp/t "$HOME/h" && echo places-writable
		ls ` + home + ` 2>/dev/null | wc -l
		grep CapEff /proc/self/status`
	res, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &out})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%v %+v\n%s", err, res, out.String())
	}
	got := out.String()
	for _, want := range []string{"pid1=bwrap", info.ID, "root-ro", "places-writable", "CapEff:\t0000000000000000"} {
		if !strings.Contains(got, want) {
			t.Errorf("inside the sandbox, missing %q in:\n%s", want, got)
		}
	}
	if strings.Contains(got, "eth") || strings.Count(strings.TrimSpace(strings.Split(got, "\n")[2]), " ") > 0 {
		t.Errorf("network interfaces besides lo:\n%s", got)
	}
	if !strings.Contains(got, "\n0\n") {
		t.Errorf("the state directory is visible inside:\n%s", got)
	}
	// Writes land under the state directory on the host.
	if _, err := os.Stat(filepath.Join(home, "sandboxes", "local", info.ID, "root", "work", "w")); err != nil {
		t.Errorf("a write to /work is not in the sandbox's directory: %v", err)
	}
	// Neither ".." nor a symlink planted inside reaches the host's files
	// through the file API: paths resolve as the sandbox sees them.
	if err := p.WriteFile(ctx, info.ID, "/work/../../etc/pwned", []byte("x"), 0o644); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("write through .. to the read-only root: %v", err)
	}
	_ = p.WriteFile(ctx, info.ID, "/work/../../../.."+home+"/pwned", []byte("x"), 0o644)
	if res, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"ln", "-s", "/", "/work/esc"}}); err != nil || res.ExitCode != 0 {
		t.Fatal(err, res)
	}
	_ = p.WriteFile(ctx, info.ID, "/work/esc"+home+"/pwned", []byte("x"), 0o644)
	_ = p.WriteFile(ctx, info.ID, "/work/esc/tmp/through-link", []byte("x"), 0o644)
	if _, err := os.Stat(filepath.Join(home, "pwned")); err == nil {
		t.Error("a write through a symlink in /work reached the host's state directory")
	}
	if b, err := p.ReadFile(ctx, info.ID, "/tmp/through-link"); err != nil || string(b) != "x" {
		t.Errorf("a write through a symlink to a writable place, as the sandbox sees it: %q %v", b, err)
	}
	if err := p.WriteFile(ctx, info.ID, "/etc/passwd", []byte("x"), 0o644); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("write outside the writable places: %v", err)
	}
}

func TestGCReapsSandboxWhoseKeeperDied(t *testing.T) {
	t.Parallel()
	p, home := newProvider(t, nil)
	ctx := context.Background()
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"sleep", "1000"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(home, "sandboxes", "local", info.ID)
	pids := hostProcesses(dir)
	if len(pids) == 0 {
		t.Fatal("no keeper found")
	}
	// Kill the keeper only: bubblewrap and the sandbox go with it. (Its
	// PID is read from keeper.json as a number: matching the file's text
	// would also take a PID that is a prefix of another one recorded.)
	b, _ := os.ReadFile(filepath.Join(dir, "keeper.json"))
	var kj struct {
		Keeper proc.Identity `json:"keeper"`
	}
	if err := json.Unmarshal(b, &kj); err != nil || !slices.Contains(pids, kj.Keeper.PID) {
		t.Fatalf("keeper pid not among %v (%s): %v", pids, b, err)
	}
	keeperPID := kj.Keeper.PID
	if err := syscall.Kill(keeperPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Gone means dead or a zombie: a process being killed loses its command
	// line before it has exited.
	deadline := time.Now().Add(10 * time.Second)
	for len(hostProcesses(dir)) > 0 || proc.Alive(kj.Keeper) {
		if time.Now().After(deadline) {
			t.Fatalf("processes outlived their keeper: %v", hostProcesses(dir))
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if _, err := p.Get(ctx, info.ID); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("get of a sandbox whose keeper died: %v", err)
	}
	reaped, err := p.GC(ctx)
	if err != nil || len(reaped) != 1 || reaped[0] != info.ID {
		st, serr := proc.ReadStat(keeperPID)
		kb, _ := os.ReadFile(filepath.Join(dir, "keeper.json"))
		t.Fatalf("gc reaped %v, %v (killed keeper %d: %+v %v; keeper.json now %s)", reaped, err, keeperPID, st, serr, kb)
	}
	if _, err := p.Get(ctx, info.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get after gc: %v", err)
	}
}
