package cli_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"stasis/internal/control/system"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// inHome runs the CLI with STASIS_HOME set, and stdin.
func inHome(t *testing.T, home, stdin string, args ...string) (string, string, int) {
	t.Helper()
	return stasistest.Run(t, []string{"STASIS_HOME=" + home}, stdin, args...)
}

func lastLine(s string) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	return l[len(l)-1]
}

func TestSandboxCLI(t *testing.T) {
	home := t.TempDir()
	seed := t.TempDir()
	if err := os.WriteFile(filepath.Join(seed, "hello.txt"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(stdin string, args ...string) (string, string, int) { return inHome(t, home, stdin, args...) }
	must := func(args ...string) string {
		t.Helper()
		out, errOut, code := run("", args...)
		if code != 0 {
			t.Fatalf("stasis %v: exit %d\n%s%s", args, code, out, errOut)
		}
		return out
	}
	id := lastLine(must("sandbox", "create", "--ttl", "10m", "--from", seed, "--label", "team=rl"))
	if !strings.HasPrefix(id, "sb-") {
		t.Fatalf("create printed %q", id)
	}
	defer func() { run("", "sandbox", "rm", id) }()

	// exec passes stdin, stdout, stderr and the exit code through.
	out, errOut, code := run("from-stdin\n", "sandbox", "exec", id, "--", "sh", "-c", "cat; cat hello.txt; echo oops >&2; exit 5")
	if code != 5 || out != "from-stdin\nhello\n" || !strings.Contains(errOut, "oops") {
		t.Fatalf("exec: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	// cp in and out.
	dir := filepath.Join(t.TempDir(), "tree")
	_ = os.MkdirAll(filepath.Join(dir, "sub"), 0o755)
	_ = os.WriteFile(filepath.Join(dir, "sub", "f"), []byte("F"), 0o600)
	must("sandbox", "cp", dir, id+":/work/tree")
	if out := must("sandbox", "exec", id, "--", "cat", "/work/tree/sub/f"); out != "F" {
		t.Fatalf("copied in: %q", out)
	}
	back := filepath.Join(t.TempDir(), "back")
	must("sandbox", "cp", id+":/work/tree", back)
	if b, _ := os.ReadFile(filepath.Join(back, "sub", "f")); string(b) != "F" {
		t.Fatalf("copied out: %q", b)
	}
	// ls, as a table and as JSON.
	if out := must("sandbox", "ls"); !strings.Contains(out, id) || !strings.Contains(out, "team=rl") {
		t.Fatalf("ls:\n%s", out)
	}
	var list []sandbox.Info
	if err := json.Unmarshal([]byte(must("sandbox", "ls", "--json", "--label", "team=rl")), &list); err != nil || len(list) != 1 || list[0].ID != id {
		t.Fatalf("ls --json: %+v %v", list, err)
	}
	// snapshot and fork.
	snap := lastLine(must("sandbox", "snapshot", id))
	if !strings.HasPrefix(snap, "snap-") {
		t.Fatalf("snapshot printed %q", snap)
	}
	forks := strings.Fields(must("sandbox", "fork", snap, "--count", "2"))
	if len(forks) != 2 {
		t.Fatalf("fork printed %q", forks)
	}
	for _, f := range forks {
		if out := must("sandbox", "exec", f, "--", "cat", "/work/hello.txt"); out != "hello\n" {
			t.Fatalf("fork %s: %q", f, out)
		}
	}
	must(append([]string{"sandbox", "rm"}, forks...)...)
	must("sandbox", "rm", id)
	must("sandbox", "rm", id) // idempotent
	// Errors: unknown id → 3, bad request → 2.
	if _, errOut, code := run("", "sandbox", "exec", id, "--", "true"); code != 3 || !strings.Contains(errOut, "not found") {
		t.Fatalf("exec in a deleted sandbox: exit %d, %s", code, errOut)
	}
	if _, errOut, code := run("", "sandbox", "fork", snap, "--count", "0"); code != 2 || !strings.Contains(errOut, "at least one") {
		t.Fatalf("fork --count 0: exit %d, %s", code, errOut)
	}
	if _, _, code := run("", "sandbox", "create", "--label", "novalue"); code != 2 {
		t.Fatalf("bad label: exit %d", code)
	}
	must("sandbox", "rm", "--snapshot", snap)
	if out := must("sandbox", "gc"); !strings.Contains(out, "0 sandboxes reaped") {
		t.Fatalf("gc: %s", out)
	}

	// --state: the sandboxes of a stasis serve on that state directory
	// (system.ProviderHome), not $STASIS_HOME's.
	state := t.TempDir()
	sid := lastLine(must("sandbox", "create", "--ttl", "10m", "--state", state))
	defer func() { run("", "sandbox", "rm", sid, "--state", state) }()
	if _, err := os.Stat(filepath.Join(system.ProviderHome(state, "local"), "sandboxes", "local", sid)); err != nil {
		t.Fatalf("--state: the sandbox is not under the serve's provider home: %v", err)
	}
	if out := must("sandbox", "ls"); strings.Contains(out, sid) {
		t.Fatalf("ls without --state lists the serve's sandbox:\n%s", out)
	}
	if out := must("sandbox", "ls", "--state", state); !strings.Contains(out, sid) {
		t.Fatalf("ls --state:\n%s", out)
	}
	must("sandbox", "rm", sid, "--state", state)
	if _, errOut, code := run("", "sandbox", "ls", "--state", filepath.Join(state, "nope")); code != 2 || !strings.Contains(errOut, "--state") {
		t.Fatalf("ls --state missing: exit %d, %s", code, errOut)
	}
	stasistest.NoChildrenLeft(t)
}

// sandbox --blobs works on a shared bucket: a snapshot deleted there is
// collected by gc (once past the grace period: not here, as it is new),
// --forget-home says what it removed or why not, on the local and the
// microvm provider, and --blobs is refused for a provider that does not
// share its snapshots.
func TestSandboxGCOnSharedBlobs(t *testing.T) {
	srv := s3test.Start(t)
	srv.Setenv(t)
	url := "s3://" + srv.Bucket(t) + "/cli"
	home := t.TempDir()
	run := func(args ...string) (string, string, int) {
		return inHome(t, home, "", append([]string{"sandbox", "--blobs", url}, args...)...)
	}
	must := func(args ...string) string {
		t.Helper()
		out, errOut, code := run(args...)
		if code != 0 {
			t.Fatalf("stasis sandbox %v: exit %d\n%s%s", args, code, out, errOut)
		}
		return out
	}
	id := lastLine(must("create", "--ttl", "10m"))
	snap := lastLine(must("snapshot", id))
	must("rm", id)
	must("rm", "--snapshot", snap)
	if out := must("gc"); !strings.Contains(out, "0 sandboxes reaped, 0 blobs (0 bytes) freed") {
		t.Fatalf("gc within the grace period: %s", out)
	}
	if _, errOut, code := run("gc", "--forget-home", "h-0123456789abcdef"); code != 3 || !strings.Contains(errOut, "no such home") {
		t.Fatalf("forget an unknown home: exit %d: %s", code, errOut)
	}
	own, err := os.ReadFile(filepath.Join(home, "home-id"))
	if err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := run("gc", "--forget-home", strings.TrimSpace(string(own))); code != 2 || !strings.Contains(errOut, "this state directory") {
		t.Fatalf("forget its own home: exit %d: %s", code, errOut)
	}
	if _, errOut, code := inHome(t, home, "", "sandbox", "gc", "--forget-home", "h-0123456789abcdef"); code != 2 || !strings.Contains(errOut, "not shared") {
		t.Fatalf("--forget-home without --blobs: exit %d: %s", code, errOut)
	}
	// The microvm provider collects the shared store too (it publishes
	// its sandboxes' bases); a provider that keeps no snapshots there is
	// refused.
	vm := func(args ...string) (string, string, int) {
		env := []string{"STASIS_HOME=" + home, "STASIS_SANDBOX_BINARY=" + stasistest.StaticBinary(t)} // the guest's
		return stasistest.Run(t, env, "", append([]string{"sandbox", "--provider", "microvm", "--blobs", url}, args...)...)
	}
	if out, errOut, code := vm("gc"); code != 0 || !strings.Contains(out, "0 sandboxes reaped, 0 blobs (0 bytes) freed") {
		t.Fatalf("gc --blobs with microvm: exit %d: %s%s", code, out, errOut)
	}
	if _, errOut, code := vm("gc", "--forget-home", "h-0123456789abcdef"); code != 3 || !strings.Contains(errOut, "no such home") {
		t.Fatalf("forget an unknown home with microvm: exit %d: %s", code, errOut)
	}
	if _, errOut, code := inHome(t, home, "", "sandbox", "--provider", "e2b", "--blobs", url, "ls"); code != 2 || !strings.Contains(errOut, "--blobs") {
		t.Fatalf("--blobs with e2b: exit %d: %s", code, errOut)
	}
	stasistest.NoChildrenLeft(t)
}
