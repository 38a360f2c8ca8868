package local_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// newLimited opens a provider whose sandboxes have low limits.
func newLimited(t *testing.T, l sandbox.Limits) *local.Provider {
	t.Helper()
	p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, Limits: l})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// waitEnded polls until sandbox id is refused for exceeding a limit, and
// returns the refusal.
func waitEnded(t *testing.T, p *local.Provider, id string) error {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		_, err := p.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{"true"}})
		if err != nil && strings.Contains(err.Error(), "limit") {
			return err
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s was not ended for its limit (last exec: %v)", id, err)
		}
		time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// neighbourWorks checks that another sandbox still runs commands.
func neighbourWorks(t *testing.T, p *local.Provider, id string) {
	t.Helper()
	out, code := run(t, p, id, sandbox.UserAgent, `i=0; while [ $i -lt 20 ]; do i=$((i+1)); done; echo neighbour-ok`)
	if code != 0 || !strings.Contains(out, "neighbour-ok") {
		t.Errorf("the neighbour sandbox: exit %d: %s", code, out)
	}
}

// TestForkBombEndsOnlyItsSandbox: finding 5. A fork bomb meets the pids
// limit, its sandbox is ended with the reason, and a neighbour goes on.
func TestForkBombEndsOnlyItsSandbox(t *testing.T) {
	t.Parallel()
	p := newLimited(t, sandbox.Limits{Pids: 64})
	bomb, neighbour := newSandbox(t, p), newSandbox(t, p)
	// Bounded: the bomb stops by itself after 20 s even if nothing ends it.
	_, err := p.Exec(context.Background(), bomb, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", `end=$(( $(date +%s) + 20 )); b() { [ $(date +%s) -lt $end ] || return; b & b & wait; }; b`}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	ended := waitEnded(t, p, bomb)
	if !errors.Is(ended, errdefs.ErrConflict) || !strings.Contains(ended.Error(), "pids") || !strings.Contains(ended.Error(), "64 processes") {
		t.Errorf("the bomb's sandbox: %v", ended)
	}
	neighbourWorks(t, p, neighbour)
}

// TestMemoryHogEndsOnlyItsSandbox: a process that allocates past the
// memory limit is killed by the kernel, its sandbox is ended with the
// reason, and a neighbour goes on.
func TestMemoryHogEndsOnlyItsSandbox(t *testing.T) {
	t.Parallel()
	p := newLimited(t, sandbox.Limits{MemoryBytes: 64 << 20})
	hog, neighbour := newSandbox(t, p), newSandbox(t, p)
	// 512 MiB in Python, written so every page is touched; the limit is 64.
	_, err := p.Exec(context.Background(), hog, sandbox.ExecRequest{
		Argv: []string{"python3", "-c", `b = bytearray(512 << 20)
for i in range(0, len(b), 4096): b[i] = 1
`}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	ended := waitEnded(t, p, hog)
	if !strings.Contains(ended.Error(), "memory") || !strings.Contains(ended.Error(), "64 MiB") {
		t.Errorf("the hog's sandbox: %v", ended)
	}
	neighbourWorks(t, p, neighbour)
}

// TestDiskAndShmLimits: /dev/shm has its size, and the writable places'
// use past the disk limit ends the sandbox.
func TestDiskAndShmLimits(t *testing.T) {
	t.Parallel()
	p := newLimited(t, sandbox.Limits{ShmBytes: 8 << 20, DiskBytes: 16 << 20})
	id := newSandbox(t, p)
	out, code := run(t, p, id, sandbox.UserAgent, `ls -ld /dev/shm; dd if=/dev/zero of=/dev/shm/x bs=1M count=16 2>&1; df -k /dev/shm | tail -1`)
	t.Logf("exit %d", code)
	if !strings.Contains(out, "No space left") {
		t.Errorf("16 MiB fit in an 8 MiB /dev/shm:\n%s", out)
	}
	if _, err := p.Exec(context.Background(), id, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", `dd if=/dev/urandom of=/work/big bs=1M count=32 2>/dev/null`}}); err != nil {
		t.Fatal(err)
	}
	ended := waitEnded(t, p, id)
	if !strings.Contains(ended.Error(), "disk") {
		t.Errorf("over the disk limit: %v", ended)
	}
}

// TestLimitsAreCgroups: everything in a sandbox, its execs included, is
// in its control groups, which go with it.
func TestLimitsAreCgroups(t *testing.T) {
	t.Parallel()
	p, home := newProvider(t, nil)
	id := newSandbox(t, p)
	out, _ := run(t, p, id, sandbox.UserAgent, `cat /proc/self/cgroup`)
	if !strings.Contains(out, "/stasis/"+id) {
		t.Fatalf("an exec is not in the sandbox's control groups:\n%s", out)
	}
	meta, err := os.ReadFile(filepath.Join(home, "sandboxes", "local", id, "meta.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, f := range strings.Split(string(meta), `"`) {
		if strings.HasPrefix(f, "/sys/fs/cgroup/") && strings.HasSuffix(f, id) {
			dirs = append(dirs, f)
		}
	}
	if len(dirs) == 0 {
		t.Fatalf("no control group in meta.json: %s", meta)
	}
	if err := p.Delete(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("control group %s left after the delete", d)
		}
	}
	_, err = local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), Limits: sandbox.Limits{Pids: 3}})
	if err == nil {
		t.Errorf("a pids limit of 3 was accepted")
	}
}
