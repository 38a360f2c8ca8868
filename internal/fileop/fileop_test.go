package fileop

import (
	"archive/tar"
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

type entry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func archive(t testing.TB, es ...entry) []byte {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range es {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Linkname: e.link, Size: int64(len(e.body))}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
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

// TestRoundTrip: a tree packed and unpacked elsewhere keeps its files,
// their permission and special bits, directories and symbolic links (as
// links, even ones that point out).
func TestRoundTrip(t *testing.T) {
	src := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "a/b"), 0o750))
	must(os.WriteFile(filepath.Join(src, "a/b/f.txt"), []byte("hello\n"), 0o640))
	must(os.WriteFile(filepath.Join(src, "run"), []byte("#!/bin/sh\n"), 0o755))
	must(os.Chmod(filepath.Join(src, "run"), 0o755|fs.ModeSetgid))
	must(os.Symlink("/etc/passwd", filepath.Join(src, "out")))
	must(os.Symlink("a/b/f.txt", filepath.Join(src, "in")))
	var b bytes.Buffer
	must(Pack(src, &b))
	dst := filepath.Join(t.TempDir(), "new")
	must(Unpack(dst, &b, nil))
	for _, c := range []struct {
		name string
		mode fs.FileMode
		body string
		link string
	}{
		{"a", fs.ModeDir | 0o750, "", ""}, {"a/b/f.txt", 0o640, "hello\n", ""}, {"run", 0o755 | fs.ModeSetgid, "#!/bin/sh\n", ""},
		{"out", fs.ModeSymlink | 0o777, "", "/etc/passwd"}, {"in", fs.ModeSymlink | 0o777, "", "a/b/f.txt"},
	} {
		p := filepath.Join(dst, c.name)
		fi, err := os.Lstat(p)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if fi.Mode() != c.mode {
			t.Errorf("%s: mode %v, want %v", c.name, fi.Mode(), c.mode)
		}
		if c.body != "" {
			if got, _ := os.ReadFile(p); string(got) != c.body {
				t.Errorf("%s: %q", c.name, got)
			}
		}
		if c.link != "" {
			if got, _ := os.Readlink(p); got != c.link {
				t.Errorf("%s -> %q, want %q", c.name, got, c.link)
			}
		}
	}
}

// TestUnpackStaysInside: names that leave the directory, links that would
// be followed out of it (from the archive, or already on disk), hard links
// to outside and device nodes are refused, naming the entry, and nothing
// is written outside.
func TestUnpackStaysInside(t *testing.T) {
	for _, c := range []struct {
		name string
		es   []entry
		pre  func(dir string) error
		says string
	}{
		{"dot-dot", []entry{{name: "../escaped", typ: tar.TypeReg, body: "x", mode: 0o644}}, nil, `".." in the path`},
		{"deep dot-dot", []entry{{name: "a/../../escaped", typ: tar.TypeReg, body: "x", mode: 0o644}}, nil, `".." in the path`},
		{"absolute", []entry{{name: "/escaped", typ: tar.TypeReg, body: "x", mode: 0o644}}, nil, "absolute"},
		{"through a link of the archive", []entry{{name: "l", typ: tar.TypeSymlink, link: ".."}, {name: "l/escaped", typ: tar.TypeReg, body: "x", mode: 0o644}}, nil, "l/escaped"},
		{"through an absolute link", []entry{{name: "l", typ: tar.TypeSymlink, link: "OUTSIDE"}, {name: "l/escaped", typ: tar.TypeReg, body: "x", mode: 0o644}}, nil, "l/escaped"},
		{"through a link on disk", []entry{{name: "d/escaped", typ: tar.TypeReg, body: "x", mode: 0o644}}, func(dir string) error { return os.Symlink("..", filepath.Join(dir, "d")) }, "d/escaped"},
		{"hard link out", []entry{{name: "h", typ: tar.TypeLink, link: "../victim"}}, nil, "link target"},
	} {
		t.Run(c.name, func(t *testing.T) {
			base := t.TempDir()
			dir := filepath.Join(base, "in")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(base, "victim"), []byte("v"), 0o644); err != nil {
				t.Fatal(err)
			}
			if c.pre != nil {
				if err := c.pre(dir); err != nil {
					t.Fatal(err)
				}
			}
			for i := range c.es {
				c.es[i].link = strings.ReplaceAll(c.es[i].link, "OUTSIDE", base)
			}
			err := Unpack(dir, bytes.NewReader(archive(t, c.es...)), nil)
			if err == nil || !strings.Contains(err.Error(), c.says) {
				t.Errorf("unpack: %v, want an error saying %q", err, c.says)
			}
			if _, err := os.Stat(filepath.Join(base, "escaped")); err == nil {
				t.Error("a file was written outside the directory")
			}
		})
	}
}

// TestUnpackLeavesOutDevices: a device node or a fifo is left out, said
// to the callback, and the rest is unpacked.
func TestUnpackLeavesOutDevices(t *testing.T) {
	dir := t.TempDir()
	var left []string
	err := Unpack(dir, bytes.NewReader(archive(t, entry{name: "null", typ: tar.TypeChar}, entry{name: "p", typ: tar.TypeFifo}, entry{name: "f", typ: tar.TypeReg, body: "x", mode: 0o644})), func(h *tar.Header) { left = append(left, h.Name) })
	if err != nil || strings.Join(left, ",") != "null,p" {
		t.Fatalf("unpack: %v, left out %v", err, left)
	}
	es, _ := os.ReadDir(dir)
	if len(es) != 1 || es[0].Name() != "f" {
		t.Errorf("unpacked %v, want f alone", es)
	}
}

// TestMain: the operations through Main, as the in-sandbox binary runs
// them, and its usage errors.
func TestMainOps(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "x/y/file")
	var out, errb bytes.Buffer
	if code := Main(Args(OpWrite, f, "640"), strings.NewReader("data"), &out, &errb); code != 0 {
		t.Fatalf("write: %d %s", code, errb.String())
	}
	if fi, err := os.Stat(f); err != nil || fi.Mode().Perm() != 0o640 {
		t.Fatalf("written file: %v %v", fi, err)
	}
	if code := Main(Args(OpCat, f), nil, &out, &errb); code != 0 || out.String() != "data" {
		t.Fatalf("cat: %d %q %s", code, out.String(), errb.String())
	}
	for _, args := range [][]string{Args("nope"), Args(OpWrite, f, "99"), Args(OpCat), {"other"}} {
		errb.Reset()
		if code := Main(args, nil, &out, &errb); code != 2 || errb.Len() == 0 {
			t.Errorf("%q: exit %d %q, want a usage error", args, code, errb.String())
		}
	}
	if code := Main(Args(OpCat, dir), nil, &out, &errb); code != 1 || !strings.Contains(errb.String(), "not a regular file") {
		t.Errorf("cat of a directory: %d %s", code, errb.String())
	}
}

// FuzzUnpack: any byte stream either unpacks inside the directory or fails;
// nothing appears beside it.
func FuzzUnpack(f *testing.F) {
	f.Add(archive(f, entry{name: "a/", typ: tar.TypeDir, mode: 0o755}, entry{name: "a/f", typ: tar.TypeReg, body: "x", mode: 0o644}))
	f.Add(archive(f, entry{name: "l", typ: tar.TypeSymlink, link: ".."}, entry{name: "l/f", typ: tar.TypeReg, body: "x", mode: 0o644}))
	f.Add(archive(f, entry{name: "h", typ: tar.TypeLink, link: "a/f"}))
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		dir := filepath.Join(base, "in")
		_ = Unpack(dir, bytes.NewReader(data), nil)
		es, err := os.ReadDir(base)
		if err != nil {
			t.Fatal(err)
		}
		if len(es) != 1 || es[0].Name() != "in" {
			t.Fatalf("beside the directory: %v", es)
		}
	})
}
