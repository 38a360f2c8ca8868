package copyout_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io/fs"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/copyout"
	"stasis/internal/providers/e2b"
	"stasis/internal/providers/e2b/e2bfake"
	"stasis/internal/providers/local"
	"stasis/internal/providers/opensandbox"
	"stasis/internal/providers/opensandbox/osfake"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// TestMain fixes the umask the modes are checked against.
func TestMain(m *testing.M) {
	syscall.Umask(0o022)
	stasistest.Main(m)
}

var ctx = context.Background()

func newLocal(t *testing.T) *local.Provider {
	t.Helper()
	p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func create(t *testing.T, p sandbox.Provider, spec sandbox.Spec) string {
	t.Helper()
	spec.Expiry = time.Now().Add(10 * time.Minute)
	info, err := p.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Delete(ctx, info.ID); err != nil {
			t.Errorf("delete %s: %v", info.ID, err)
		}
	})
	return info.ID
}

func sh(t *testing.T, p sandbox.Provider, id string, u sandbox.User, script string) string {
	t.Helper()
	var out bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, User: u, Stdout: &out, Stderr: &out, Timeout: time.Minute})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d, %v\n%s", script, res.ExitCode, err, out.String())
	}
	return out.String()
}

// The agent's tree: setuid and setgid copies of id(1) made by the agent
// and by stasis's own user (root in the sandbox's user namespace), a
// setgid directory, a sticky file and a fifo.
const agentTree = `set -e
mkdir -p /work/out/sub
cp /usr/bin/id /work/out/agent-suid && chmod 4755 /work/out/agent-suid
mkfifo /work/out/fifo
mkdir /work/out/gdir && chmod 2775 /work/out/gdir
chmod 777 /work/out /work/out/sub`

const controlTree = `set -e
cp /usr/bin/id /work/out/suid && chmod 4755 /work/out/suid
cp /usr/bin/id /work/out/sub/sgid && chmod 2755 /work/out/sub/sgid
touch /work/out/sticky && chmod 1755 /work/out/sticky
stat -c '%a %u %n' /work/out/suid /work/out/sub/sgid /work/out/gdir /work/out/sticky /work/out/agent-suid`

// TestLocalSetuidCopiedOut acts as the agent of finding 6: setuid and
// setgid files made in a real local sandbox and copied out with the
// provider API arrive without those bits, the host user's, and running one
// as an unprivileged host user gives that user nothing more.
func TestLocalSetuidCopiedOut(t *testing.T) {
	t.Parallel()
	p := newLocal(t)
	id := create(t, p, sandbox.Spec{})
	sh(t, p, id, sandbox.UserAgent, agentTree)
	modes := sh(t, p, id, sandbox.UserControl, controlTree)
	for _, want := range []string{"4755 0 /work/out/suid", "2755 0 /work/out/sub/sgid", "2775 1000 /work/out/gdir", "1755 0 /work/out/sticky", "4755 1000 /work/out/agent-suid"} {
		if !strings.Contains(modes, want) {
			t.Fatalf("the sandbox did not make what the test copies out: want %q in\n%s", want, modes)
		}
	}
	base := hostDir(t)
	dst := filepath.Join(base, "tree")
	var warned []string
	res, err := copyout.Copy(ctx, p, id, "/work/out", dst, copyout.Options{Warn: func(s copyout.Skipped) { warned = append(warned, s.String()) }})
	if err != nil {
		t.Fatal(err)
	}
	if res.Files != 4 || len(warned) != 1 || !strings.HasPrefix(warned[0], `"fifo": `) {
		t.Fatalf("copied %+v, warnings %q", res, warned)
	}
	checkTree(t, dst)
	// One file, by ReadFile.
	one := filepath.Join(base, "one")
	if _, err := copyout.Copy(ctx, p, id, "/work/out/suid", one, copyout.Options{}); err != nil {
		t.Fatal(err)
	}
	checkFile(t, one, 0o644)
	if err := os.Chmod(one, 0o755); err != nil { // what a user would do next
		t.Fatal(err)
	}
	runAsNobody(t, base, filepath.Join(dst, "suid"), one, filepath.Join(dst, "agent-suid"))

	// A fifo in a file's place is refused, not read (which would block
	// forever), and leaves nothing behind.
	fctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	fifo := filepath.Join(base, "fifo")
	if _, err := copyout.Copy(fctx, p, id, "/work/out/fifo", fifo, copyout.Options{}); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("copying out a fifo: %v", err)
	}
	if _, err := os.Lstat(fifo); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("copying out a fifo left %s: %v", fifo, err)
	}
}

// hostDir is a temporary directory that an unprivileged user can reach.
func hostDir(t *testing.T) string {
	t.Helper()
	d := t.TempDir()
	for p := d; p != os.TempDir() && p != "/"; p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

func owner(t *testing.T, p string) (fs.FileMode, int, int) {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	return fi.Mode(), int(st.Uid), int(st.Gid)
}

func checkFile(t *testing.T, p string, want fs.FileMode) {
	t.Helper()
	m, uid, gid := owner(t, p)
	if m != want || uid != os.Getuid() || gid != os.Getgid() {
		t.Errorf("%s: mode %v owner %d:%d; want %v owned by the host user %d:%d", p, m, uid, gid, want, os.Getuid(), os.Getgid())
	}
}

// checkTree checks the copy of agentTree and controlTree.
func checkTree(t *testing.T, dst string) {
	t.Helper()
	checkFile(t, filepath.Join(dst, "suid"), 0o755)
	checkFile(t, filepath.Join(dst, "agent-suid"), 0o755)
	checkFile(t, filepath.Join(dst, "sub", "sgid"), 0o755)
	checkFile(t, filepath.Join(dst, "sticky"), 0o755)
	checkFile(t, filepath.Join(dst, "sub"), fs.ModeDir|0o755) // 0777 in the sandbox, less the umask
	checkFile(t, filepath.Join(dst, "gdir"), fs.ModeDir|0o755)
	if _, err := os.Lstat(filepath.Join(dst, "fifo")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the fifo was made on the host: %v", err)
	}
}

// runAsNobody runs each copied-out id(1) as nobody and checks it prints
// nobody's uid; first, that a setuid-root id made on the host here gives
// root, so that the check can fail (the file system is not nosuid).
func runAsNobody(t *testing.T, dir string, copies ...string) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Log("not root: cannot run the copies as another user (their modes were checked)")
		return
	}
	euid := func(bin string) string {
		out, err := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", bin, "-u").CombinedOutput()
		if err != nil {
			t.Fatalf("%s as nobody: %v: %s", bin, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	control := filepath.Join(dir, "host-suid")
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
		t.Logf("a setuid-root file on the host gives euid %s here (nosuid?): the modes were checked, the run proves nothing more", got)
		return
	}
	for _, c := range copies {
		if got := euid(c); got != "65534" {
			t.Errorf("%s, copied out, run by nobody gave euid %s", c, got)
		}
	}
}

// hostile is a crafted tar stream as an agent that owns its sandbox's tar
// would hand out: a setuid file, devices, a fifo, "..", an absolute name,
// symlinks out with writes through them, and hard links out.
func hostile(t *testing.T, outside string) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	add := func(name string, typ byte, mode int64, link, body string) {
		h := &tar.Header{Name: name, Typeflag: typ, Mode: mode, Linkname: link, Size: int64(len(body)), Uid: 0, Gid: 0, ModTime: time.Now(), Devmajor: 1, Devminor: 3}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(body)); err != nil {
			t.Fatal(err)
		}
	}
	add("./", tar.TypeDir, 0o755, "", "")
	add("./ok", tar.TypeReg, 0o4755, "", "ok")
	add("./null", tar.TypeChar, 0o666, "", "")
	add("./disk", tar.TypeBlock, 0o660, "", "")
	add("./pipe", tar.TypeFifo, 0o644, "", "")
	add("../escape", tar.TypeReg, 0o644, "", "escaped")
	add(filepath.Join(outside, "abs"), tar.TypeReg, 0o644, "", "escaped")
	add("./out", tar.TypeSymlink, 0, outside, "")
	add("./out/victim", tar.TypeReg, 0o644, "", "overwritten")
	add("./up", tar.TypeSymlink, 0, "..", "")
	add("./up/outside/victim", tar.TypeReg, 0o644, "", "overwritten")
	add("./hard", tar.TypeLink, 0, filepath.Join(outside, "victim"), "")
	add("./hard2", tar.TypeLink, 0, "../outside/victim", "")
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// agentTar is the agent's tar(1), first on PATH: every archive it makes
// is the crafted one.
const agentTar = `#!/bin/sh
[ "$1" = -c ] || exec /usr/bin/tar "$@"
out=- prev=
for a in "$@"; do [ "$prev" = -f ] && out=$a; prev=$a; done
if [ "$out" = - ]; then exec cat /work/.agent/evil.tar; fi
exec cp /work/.agent/evil.tar "$out"
`

// TestHostedCraftedStreams: on the hosted providers (their fakes, speaking
// their published APIs) the agent is root and owns tar; a crafted stream
// it hands out writes nothing outside the destination, makes no device,
// and a truncated one is an error saying so.
func TestHostedCraftedStreams(t *testing.T) {
	t.Parallel()
	spec := sandbox.Spec{Env: map[string]string{"PATH": "/work/.agent/bin:/usr/local/bin:/usr/bin:/bin"}}
	for _, c := range []struct {
		name string
		p    func(t *testing.T) sandbox.Provider
	}{
		{"e2b", func(t *testing.T) sandbox.Provider {
			f := e2bfake.New(newLocal(t), e2bfake.Options{})
			srv := httptest.NewServer(f)
			t.Cleanup(srv.Close)
			t.Cleanup(func() { _ = f.Close() })
			p, err := e2b.New(e2b.Options{APIKey: f.APIKey(), BaseURL: srv.URL, EnvdURL: srv.URL, FileOnlySnapshots: true, Backoff: 20 * time.Millisecond, ReapInterval: -1})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Close() })
			return p
		}},
		{"opensandbox", func(t *testing.T) sandbox.Provider {
			f := osfake.New(osfake.Options{Backend: newLocal(t), APIKey: "test-key"})
			srv := httptest.NewServer(f)
			t.Cleanup(func() {
				srv.Close()
				f.Close()
			})
			p, err := opensandbox.New(opensandbox.Options{URL: srv.URL, APIKey: "test-key", PollInterval: 10 * time.Millisecond, RetryBase: 10 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Close() })
			return p
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := c.p(t)
			id := create(t, p, spec)
			base := t.TempDir()
			dst, outside := filepath.Join(base, "dst"), filepath.Join(base, "outside")
			if err := os.Mkdir(outside, 0o755); err != nil {
				t.Fatal(err)
			}
			victim := filepath.Join(outside, "victim")
			if err := os.WriteFile(victim, []byte("victim"), 0o644); err != nil {
				t.Fatal(err)
			}
			evil := hostile(t, outside)
			if err := p.WriteFile(ctx, id, "/work/.agent/bin/tar", []byte(agentTar), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := p.WriteFile(ctx, id, "/work/.agent/evil.tar", evil, 0o644); err != nil {
				t.Fatal(err)
			}
			var warned []string
			res, err := copyout.Download(ctx, p, id, "/work", dst, copyout.Options{Warn: func(s copyout.Skipped) { warned = append(warned, s.Name) }})
			if err != nil {
				t.Fatal(err)
			}
			if res.Files != 1 {
				t.Errorf("copied %+v, want the one regular file", res)
			}
			want := []string{"null", "disk", "pipe", "../escape", filepath.Join(outside, "abs"), "out", "out/victim", "up", "up/outside/victim", "hard", "hard2"}
			if strings.Join(warned, ",") != strings.Join(want, ",") {
				t.Errorf("warnings for %q, want %q", warned, want)
			}
			// Nothing outside dst: base holds dst and outside, outside
			// holds the victim, unchanged.
			for dir, want := range map[string]string{base: "dst,outside", outside: "victim"} {
				es, _ := os.ReadDir(dir)
				var names []string
				for _, e := range es {
					names = append(names, e.Name())
				}
				if got := strings.Join(names, ","); got != want {
					t.Errorf("%s holds %s, want %s", dir, got, want)
				}
			}
			if b, _ := os.ReadFile(victim); string(b) != "victim" {
				t.Errorf("the victim outside now reads %q", b)
			}
			if _, _, nlink := linkCount(t, victim); nlink != 1 {
				t.Errorf("the victim outside has %d links", nlink)
			}
			es, _ := os.ReadDir(dst)
			if len(es) != 1 || es[0].Name() != "ok" {
				t.Errorf("the destination holds %v, want only ok", es)
			}
			checkFile(t, filepath.Join(dst, "ok"), 0o755)

			// A truncated stream is an error saying so.
			if err := p.WriteFile(ctx, id, "/work/.agent/evil.tar", evil[:700], 0o644); err != nil {
				t.Fatal(err)
			}
			_, err = copyout.Download(ctx, p, id, "/work", filepath.Join(base, "dst2"), copyout.Options{})
			var me *copyout.MalformedError
			if !errors.As(err, &me) || !strings.Contains(err.Error(), "truncated") {
				t.Errorf("a truncated stream: %v", err)
			}
		})
	}
}

func linkCount(t *testing.T, p string) (int, int, int) {
	t.Helper()
	_, uid, gid := owner(t, p)
	fi, _ := os.Lstat(p)
	return uid, gid, int(fi.Sys().(*syscall.Stat_t).Nlink)
}
