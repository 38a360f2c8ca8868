package copyout

import (
	"archive/tar"
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// entry is one crafted tar entry.
type entry struct {
	name     string
	typ      byte
	mode     int64
	body     string
	linkname string
	uid      int
}

// craft makes a tar stream of the entries as given, with nothing checked.
func craft(t testing.TB, es ...entry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range es {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Linkname: e.linkname, Uid: e.uid, Gid: e.uid,
			ModTime: time.Unix(1_700_000_000, 0), Format: tar.FormatGNU}
		if e.typ == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if e.typ == tar.TypeChar || e.typ == tar.TypeBlock {
			h.Devmajor, h.Devminor = 1, 3
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			if _, err := tw.Write([]byte(e.body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// layout is a destination inside a base directory that also holds a
// directory "outside" with one file, "victim": what an escape would hit.
type layout struct{ base, dst, outside, victim string }

func newLayout(t testing.TB) layout {
	base := t.TempDir()
	l := layout{base: base, dst: filepath.Join(base, "dst"), outside: filepath.Join(base, "outside")}
	l.victim = filepath.Join(l.outside, "victim")
	if err := os.Mkdir(l.outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(l.victim, []byte("victim"), 0o644); err != nil {
		t.Fatal(err)
	}
	return l
}

// untouched fails the test if anything outside dst changed: base holds
// dst and outside only, and outside holds victim, unchanged and with one
// link.
func (l layout) untouched(t testing.TB) {
	t.Helper()
	names := func(dir string) []string {
		es, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var n []string
		for _, e := range es {
			n = append(n, e.Name())
		}
		return n
	}
	if got := strings.Join(names(l.base), ","); got != "dst,outside" && got != "outside" {
		t.Errorf("outside the destination: %s holds %s", l.base, got)
	}
	if got := strings.Join(names(l.outside), ","); got != "victim" {
		t.Errorf("outside the destination: %s holds %s", l.outside, got)
	}
	fi, err := os.Lstat(l.victim)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(l.victim)
	if string(b) != "victim" || fi.Mode() != 0o644 || fi.Sys().(*syscall.Stat_t).Nlink != 1 {
		t.Errorf("the victim outside changed: %q %v nlink %d", b, fi.Mode(), fi.Sys().(*syscall.Stat_t).Nlink)
	}
}

// safe fails the test if dst holds anything copy-out must not make: a
// setuid or setgid file or directory, a sticky file, a device, a fifo or a
// socket, a file not the host user's, or a symlink that leads out of dst.
func safe(t testing.TB, dst string) {
	t.Helper()
	realDst, err := filepath.EvalSymlinks(dst)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return
		}
		t.Fatal(err)
	}
	err = filepath.WalkDir(dst, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		m := fi.Mode()
		if m&(fs.ModeSetuid|fs.ModeSetgid) != 0 || (!m.IsDir() && m&fs.ModeSticky != 0) {
			t.Errorf("%s has mode %v", p, m)
		}
		if m&(fs.ModeDevice|fs.ModeCharDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
			t.Errorf("%s was made, of type %v", p, m.Type())
		}
		if st := fi.Sys().(*syscall.Stat_t); int(st.Uid) != os.Getuid() || int(st.Gid) != os.Getgid() {
			t.Errorf("%s belongs to %d:%d, not to the host user %d:%d", p, st.Uid, st.Gid, os.Getuid(), os.Getgid())
		}
		if m&fs.ModeSymlink != 0 {
			target, _ := os.Readlink(p)
			if filepath.IsAbs(target) {
				t.Errorf("%s is a symlink to the absolute %s", p, target)
			}
			if r, err := filepath.EvalSymlinks(p); err == nil && r != realDst && !strings.HasPrefix(r, realDst+"/") {
				t.Errorf("%s is a symlink leading to %s, outside %s", p, r, realDst)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func mode(t *testing.T, p string) fs.FileMode {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode()
}

func TestExtractDropsSpecialBitsAndOwners(t *testing.T) {
	l := newLayout(t)
	stream := craft(t,
		entry{name: "./", typ: tar.TypeDir, mode: 0o755},
		entry{name: "./g/", typ: tar.TypeDir, mode: 0o2775, uid: 0},
		entry{name: "./shared/", typ: tar.TypeDir, mode: 0o1777},
		entry{name: "./ro/", typ: tar.TypeDir, mode: 0o555},
		entry{name: "./ro/in", typ: tar.TypeReg, mode: 0o644, body: "in a read-only directory"},
		entry{name: "./suid", typ: tar.TypeReg, mode: 0o4755, body: "#!/bin/sh\nid\n", uid: 0},
		entry{name: "./g/sgid", typ: tar.TypeReg, mode: 0o2755, body: "x", uid: 1000},
		entry{name: "./sticky", typ: tar.TypeReg, mode: 0o1644, body: "x", uid: 65534},
		entry{name: "./all", typ: tar.TypeReg, mode: 0o7777, body: "x"},
		entry{name: "./hard", typ: tar.TypeLink, linkname: "./suid"},
		entry{name: "./rel", typ: tar.TypeSymlink, linkname: "g/sgid"},
	)
	res, err := Extract(bytes.NewReader(stream), l.dst, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Skipped) != 0 || res.Files != 5 || res.Dirs != 3 || res.Links != 1 || res.Symlinks != 1 {
		t.Fatalf("result %+v", res)
	}
	um := umask()
	for name, want := range map[string]fs.FileMode{
		"suid": 0o755, "g/sgid": 0o755, "sticky": 0o644, "all": 0o777, "hard": 0o755, "ro/in": 0o644,
		"g": fs.ModeDir | 0o775, "shared": fs.ModeDir | fs.ModeSticky | 0o777, "ro": fs.ModeDir | 0o555,
	} {
		if got, want := mode(t, filepath.Join(l.dst, name)), want&^um; got != want {
			t.Errorf("%s: mode %v, want %v", name, got, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(l.dst, "rel")); string(b) != "x" {
		t.Errorf("the symlink inside reads %q", b)
	}
	safe(t, l.dst)
	l.untouched(t)
	if err := os.Chmod(filepath.Join(l.dst, "ro"), 0o755); err != nil { // for t.TempDir's removal as non-root
		t.Fatal(err)
	}
}

func TestExtractRefusesHostileEntries(t *testing.T) {
	l := newLayout(t)
	// dst already holds a symlink out, which an entry of the same name
	// must replace, not write through.
	if err := os.MkdirAll(l.dst, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(l.victim, filepath.Join(l.dst, "planted")); err != nil {
		t.Fatal(err)
	}
	stream := craft(t,
		entry{name: "dev-null", typ: tar.TypeChar, mode: 0o666},
		entry{name: "disk", typ: tar.TypeBlock, mode: 0o660},
		entry{name: "pipe", typ: tar.TypeFifo, mode: 0o644},
		entry{name: "../escape", typ: tar.TypeReg, mode: 0o644, body: "escaped"},
		entry{name: "a/../../escape", typ: tar.TypeReg, mode: 0o644, body: "escaped"},
		entry{name: filepath.Join(l.outside, "abs"), typ: tar.TypeReg, mode: 0o644, body: "escaped"},
		// a symlink out, then a write through it
		entry{name: "out", typ: tar.TypeSymlink, linkname: l.outside},
		entry{name: "out/victim", typ: tar.TypeReg, mode: 0o644, body: "overwritten"},
		entry{name: "up", typ: tar.TypeSymlink, linkname: ".."},
		entry{name: "up/outside/victim", typ: tar.TypeReg, mode: 0o644, body: "overwritten"},
		// a link inside that leads out by way of another
		entry{name: "d/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "d/self", typ: tar.TypeSymlink, linkname: "."},
		entry{name: "d/self2", typ: tar.TypeSymlink, linkname: "../d/self"},
		entry{name: "sneak", typ: tar.TypeSymlink, linkname: "d/self/../../outside"},
		entry{name: "sneak/victim", typ: tar.TypeReg, mode: 0o644, body: "overwritten"},
		entry{name: "loop", typ: tar.TypeSymlink, linkname: "loop"},
		// hard links out
		entry{name: "hard-abs", typ: tar.TypeLink, linkname: l.victim},
		entry{name: "hard-up", typ: tar.TypeLink, linkname: "../outside/victim"},
		entry{name: "hard-through", typ: tar.TypeLink, linkname: "planted"},
		// the planted symlink replaced by a file
		entry{name: "planted", typ: tar.TypeReg, mode: 0o644, body: "replaced"},
		entry{name: ".", typ: tar.TypeReg, body: "the destination itself"},
		entry{name: "kept", typ: tar.TypeReg, mode: 0o644, body: "kept"},
	)
	var warned []string
	res, err := Extract(bytes.NewReader(stream), l.dst, Options{Warn: func(s Skipped) { warned = append(warned, s.String()) }})
	if err != nil {
		t.Fatal(err)
	}
	l.untouched(t)
	safe(t, l.dst)
	for _, name := range []string{"dev-null", "disk", "pipe", "../escape", "a/../../escape", filepath.Join(l.outside, "abs"), "out", "out/victim",
		"up", "up/outside/victim", "sneak", "loop", "hard-abs", "hard-up", "hard-through", "."} {
		found := false
		for _, w := range warned {
			found = found || strings.HasPrefix(w, `"`+name+`": `)
		}
		if !found {
			t.Errorf("no warning names %q; the warnings:\n%s", name, strings.Join(warned, "\n"))
		}
	}
	if len(res.Skipped) != len(warned) {
		t.Errorf("%d skipped, %d warnings", len(res.Skipped), len(warned))
	}
	for _, name := range []string{"dev-null", "disk", "pipe", "out", "up", "sneak", "loop", "hard-abs", "hard-up", "hard-through"} {
		if _, err := os.Lstat(filepath.Join(l.dst, name)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s is in the destination: %v", name, err)
		}
	}
	for name, want := range map[string]string{"planted": "replaced", "kept": "kept"} {
		if b, err := os.ReadFile(filepath.Join(l.dst, name)); string(b) != want {
			t.Errorf("%s: %q %v", name, b, err)
		}
	}
	if mode(t, filepath.Join(l.dst, "planted"))&fs.ModeSymlink != 0 {
		t.Error("the planted symlink is still there")
	}
	// Links inside are kept.
	if mode(t, filepath.Join(l.dst, "d", "self2"))&fs.ModeSymlink == 0 {
		t.Error("the link d/self2 (inside) was not kept")
	}
}

func TestExtractMalformed(t *testing.T) {
	good := craft(t, entry{name: "a", typ: tar.TypeReg, mode: 0o644, body: strings.Repeat("x", 3000)}, entry{name: "b", typ: tar.TypeReg, mode: 0o644, body: "b"})
	for _, c := range []struct {
		name, want string
		stream     []byte
	}{
		{"truncated in data", `truncated (in the data of entry "a")`, good[:1000]},
		{"truncated in a header", "truncated (after 1 entries)", good[:512*7+100]},
		{"garbage", "malformed (after 0 entries)", bytes.Repeat([]byte("not a tar stream "), 64)},
		{"bad checksum", "malformed (after 0 entries)", func() []byte {
			b := bytes.Clone(good)
			b[0] ^= 0xff
			return b
		}()},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := newLayout(t)
			_, err := Extract(bytes.NewReader(c.stream), l.dst, Options{})
			var me *MalformedError
			if !errors.As(err, &me) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), l.dst) {
				t.Fatalf("error %v, want a *MalformedError saying %q", err, c.want)
			}
			l.untouched(t)
			safe(t, l.dst)
		})
	}
	// An empty stream is an empty tree.
	l := newLayout(t)
	if res, err := Extract(bytes.NewReader(nil), l.dst, Options{}); err != nil || res.Files != 0 {
		t.Fatalf("empty stream: %+v %v", res, err)
	}
}

func TestCleanName(t *testing.T) {
	for in, want := range map[string]string{
		"./a": "a", "a/": "a", "a/./b": "a/b", "a/../b": "b", ".": ".", "./": ".",
		"..": "", "../a": "", "a/../..": "", "/etc/passwd": "", "": "", "a\x00b": "",
	} {
		got, ok := cleanName(in)
		if (want == "") == ok || (ok && got != want) {
			t.Errorf("cleanName(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
}

// FuzzExtract extracts arbitrary streams: whatever they hold, nothing is
// written outside the destination, and nothing unsafe lands inside it.
func FuzzExtract(f *testing.F) {
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, stream []byte) {
		l := newLayout(t)
		_, _ = Extract(bytes.NewReader(stream), l.dst, Options{})
		l.untouched(t)
		safe(t, l.dst)
		// Read-only directories would stop t.TempDir's removal as non-root.
		_ = filepath.WalkDir(l.dst, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				_ = os.Chmod(p, 0o755)
			}
			return nil
		})
	})
}
