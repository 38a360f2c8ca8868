package cli_test

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// TestSandboxCpOutIsSafe acts as the agent of issue 18's finding 6: it
// makes setuid and setgid copies of id(1) in a local sandbox, as the agent
// and as stasis's own user (root in the sandbox's user namespace), and a
// fifo; `stasis sandbox cp` brings them out without those bits, owned by
// the host user, the fifo named in a warning and not made, and a copy run
// by an unprivileged host user gives it nobody else's uid.
func TestSandboxCpOutIsSafe(t *testing.T) {
	home := t.TempDir()
	run := func(args ...string) (string, string) {
		t.Helper()
		out, errOut, code := inHome(t, home, "", args...)
		if code != 0 {
			t.Fatalf("stasis %v: exit %d\n%s%s", args, code, out, errOut)
		}
		return out, errOut
	}
	out, _ := run("sandbox", "create", "--ttl", "10m")
	id := lastLine(out)
	defer inHome(t, home, "", "sandbox", "rm", id)

	// The same state directory, opened here, runs a command as stasis's
	// own user, which the CLI does not offer.
	p, err := local.New(local.Options{Home: home, Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	sh := func(u sandbox.User, script string) string {
		t.Helper()
		var b bytes.Buffer
		res, err := p.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, User: u, Stdout: &b, Stderr: &b, Timeout: time.Minute})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec %q: exit %d, %v\n%s", script, res.ExitCode, err, b.String())
		}
		return b.String()
	}
	sh(sandbox.UserAgent, `set -e; mkdir -p /work/out; cp /usr/bin/id /work/out/agent-suid; chmod 4755 /work/out/agent-suid
mkdir /work/out/gdir; chmod 2775 /work/out/gdir; mkfifo /work/out/fifo; chmod 777 /work/out`)
	modes := sh(sandbox.UserControl, `set -e; cp /usr/bin/id /work/out/suid; chmod 4755 /work/out/suid
cp /usr/bin/id /work/out/sgid; chmod 2755 /work/out/sgid; stat -c '%a %u %n' /work/out/*`)
	for _, want := range []string{"4755 0 /work/out/suid", "2755 0 /work/out/sgid", "4755 1000 /work/out/agent-suid", "2775 1000 /work/out/gdir"} {
		if !strings.Contains(modes, want) {
			t.Fatalf("the sandbox did not make what the test copies out: want %q in\n%s", want, modes)
		}
	}

	base := t.TempDir()
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Dir(base), 0o755); err != nil {
		t.Fatal(err)
	}
	tree := filepath.Join(base, "tree")
	_, errOut := run("sandbox", "cp", id+":/work/out", tree)
	if !strings.Contains(errOut, `warning: not copied: "fifo": a fifo is never made on the host`) {
		t.Errorf("no warning names the fifo:\n%s", errOut)
	}
	one := filepath.Join(base, "one")
	run("sandbox", "cp", id+":/work/out/suid", one)

	um := umask(t)
	for name, want := range map[string]fs.FileMode{
		"tree/suid": 0o755, "tree/sgid": 0o755, "tree/agent-suid": 0o755, "tree/gdir": fs.ModeDir | 0o775, "one": 0o644,
	} {
		fi, err := os.Lstat(filepath.Join(base, name))
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if want &^= um; fi.Mode() != want || int(st.Uid) != os.Getuid() || int(st.Gid) != os.Getgid() {
			t.Errorf("%s: mode %v owner %d:%d; want %v owned by the host user %d:%d", name, fi.Mode(), st.Uid, st.Gid, want, os.Getuid(), os.Getgid())
		}
	}
	if _, err := os.Lstat(filepath.Join(tree, "fifo")); !os.IsNotExist(err) {
		t.Errorf("the fifo was made on the host: %v", err)
	}

	// Run as nobody, the copies give nobody's uid; a setuid-root file made
	// on the host here gives root, so that this can fail.
	if os.Getuid() != 0 {
		return
	}
	euid := func(bin string) string {
		t.Helper()
		out, err := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", bin, "-u").CombinedOutput()
		if err != nil {
			t.Fatalf("%s as nobody: %v: %s", bin, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	control := filepath.Join(base, "host-suid")
	b, err := os.ReadFile("/usr/bin/id")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(control, b, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(control)
	if err := os.Chmod(control, fs.ModeSetuid|0o755); err != nil {
		t.Fatal(err)
	}
	if got := euid(control); got != "0" {
		t.Logf("a setuid-root file on the host gives euid %s here: the modes were checked, the run proves nothing more", got)
		return
	}
	for _, c := range []string{"tree/suid", "tree/agent-suid"} {
		if got := euid(filepath.Join(base, c)); got != "65534" {
			t.Errorf("%s, copied out, run by nobody gave euid %s", c, got)
		}
	}
}

// umask is the test process's (and so its children's) umask.
func umask(t *testing.T) fs.FileMode {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Umask:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32)
			if err != nil {
				t.Fatal(err)
			}
			return fs.FileMode(m)
		}
	}
	t.Fatal("no Umask in /proc/self/status")
	return 0
}
