// Package stasistest holds what stasis's tests share: running the test
// binary as the stasis binary, and checking that a test left no process
// behind.
package stasistest

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/control/cli"
	"stasis/internal/proc"
	"stasis/internal/testsvc"
)

// envAsCLI makes a test binary run the stasis command line instead of its
// tests.
const envAsCLI = "STASIS_TEST_AS_CLI"

// Env is the environment to give a child that must act as stasis. A
// child host process (a `stasis serve` a test starts) places this very
// test binary in its sandboxes, as the in-sandbox binary.
var Env = []string{envAsCLI + "=1", "GORACE=atexit_sleep_ms=0", "STASIS_SANDBOX_BINARY=" + os.Args[0]}

// EnvMap is Env as a map, for sandbox exec environments. GORACE's
// atexit_sleep_ms=0 spares every short-lived copy of a -race test binary
// the race runtime's one-second sleep at exit.
var EnvMap = func() map[string]string {
	m := map[string]string{}
	for _, kv := range Env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}()

// cleanups run after the tests (what the helpers made once per process).
var (
	cleanupsMu sync.Mutex
	cleanups   []func()
)

// addCleanup has f run after the tests.
func addCleanup(f func()) {
	cleanupsMu.Lock()
	defer cleanupsMu.Unlock()
	cleanups = append(cleanups, f)
}

var seedDir struct {
	once sync.Once
	dir  string
	err  error
}

// SeedDir is a directory for task.Verifier.SeedDir shared by the tests of
// one process (removed after them), so a Go task's build cache seed is
// made once per package's run.
func SeedDir(tb testing.TB) string {
	tb.Helper()
	seedDir.once.Do(func() {
		seedDir.dir, seedDir.err = os.MkdirTemp(tmpRoot, "stasis-test-seeds-")
		if seedDir.err == nil {
			addCleanup(func() { os.RemoveAll(seedDir.dir) })
		}
	})
	if seedDir.err != nil {
		tb.Fatal(seedDir.err)
	}
	return seedDir.dir
}

// Main is TestMain for packages whose tests start stasis processes: with
// STASIS_TEST_AS_CLI set the binary runs the real command line (so the
// supervisors and shims under test are this very binary, built with -race
// when the tests are); otherwise it runs the tests, and then fails the run
// if any process they started is still there (parallel tests share the
// test process, so only here, after all of them, is "no child left" a
// question with one answer).
func Main(m *testing.M) {
	if os.Getenv(envAsCLI) == "1" {
		os.Exit(cli.Main(os.Args[1:]))
	}
	code := m.Run()
	if staticDir != "" {
		_ = os.RemoveAll(staticDir)
	}
	cleanupsMu.Lock()
	for _, c := range cleanups {
		c()
	}
	cleanupsMu.Unlock()
	if err := testsvc.StopAll(); err != nil {
		fmt.Fprintln(os.Stderr, "FAIL: stopping the test services:", err)
		code = 1
	}
	if code == 0 {
		if left := childrenLeft(10 * time.Second); len(left) > 0 {
			fmt.Fprintf(os.Stderr, "FAIL: processes left behind by the tests: %+v\n", left)
			code = 1
		}
	}
	os.Exit(code)
}

// childrenLeft waits up to timeout for the test process to have no
// descendant, and returns those still there.
func childrenLeft(timeout time.Duration) []proc.Stat {
	deadline := time.Now().Add(timeout)
	for {
		kids, err := proc.Descendants(os.Getpid())
		kids = notServices(kids)
		if err == nil && len(kids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return kids
		}
		time.Sleep(10 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// notServices drops from kids the shared test services (package testsvc)
// and what they started.
func notServices(kids []proc.Stat) []proc.Stat {
	all := make(map[int]proc.Stat, len(kids))
	for _, k := range kids {
		all[k.PID] = k
	}
	owned := testsvc.Owns(all)
	out := kids[:0]
	for _, k := range kids {
		if !owned[k.PID] {
			out = append(out, k)
		}
	}
	return out
}

var (
	staticDir    string // removed by Main
	staticBinary = oncePerProcess(buildStatic)
)

// StaticBinary builds the lean in-sandbox stasis (cmd/stasis-sandbox) from
// this module with CGO_ENABLED=0 (a static binary, what a microVM guest
// runs: the test binary itself is built with -race and so links libc) once
// per test process, and returns its path; Main removes it after the tests.
func StaticBinary(tb testing.TB) string {
	tb.Helper()
	return staticBinary(tb)
}

func buildStatic() (string, error) {
	var err error
	if staticDir, err = os.MkdirTemp(tmpRoot, "stasis-static-"); err != nil {
		return "", err
	}
	bin := filepath.Join(staticDir, "stasis")
	cmd := exec.Command("go", "build", "-o", bin, "stasis/cmd/stasis-sandbox")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build a static stasis: %v: %s", err, out)
	}
	return bin, nil
}

// oncePerProcess makes what build makes the first time it is asked for in
// a test process; the test fails when that failed (then and at every later
// ask).
func oncePerProcess(build func() (string, error)) func(testing.TB) string {
	get := sync.OnceValues(build)
	return func(tb testing.TB) string {
		tb.Helper()
		v, err := get()
		if err != nil {
			tb.Fatal(err)
		}
		return v
	}
}

// Exe is the binary to start as stasis, with Env.
func Exe() string { return os.Args[0] }

// NoChildrenLeft fails the test unless, within ten seconds, the test process
// has no descendant left.
func NoChildrenLeft(t testing.TB) {
	t.Helper()
	if left := childrenLeft(10 * time.Second); len(left) > 0 {
		t.Fatalf("processes left behind: %+v", left)
	}
}

// Run runs this test binary as stasis with args, the extra environment env
// (Env is added), and stdin; it returns stdout, stderr and the exit code.
func Run(t testing.TB, env []string, stdin string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(Exe(), args...)
	cmd.Env = append(append(os.Environ(), Env...), env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

// FreeLoopbackAddr returns a loopback TCP address ("127.0.0.1:PORT") that
// nothing listens on now, for a server a test starts as another process.
// Another process may take the port before that server does; the tests
// that use it accept that small race.
func FreeLoopbackAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}
