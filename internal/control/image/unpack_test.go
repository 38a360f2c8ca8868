package image

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
)

// rawTar writes headers (and a body of Size bytes for each regular file).
func rawTar(t testing.TB, hs ...*tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range hs {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg && h.Size > 0 {
			if _, err := tw.Write(bytes.Repeat([]byte("x"), int(h.Size))); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// unpackInto runs the unpacker over b into a fresh root under a fresh
// directory, beside which outside is a directory nothing may touch.
func unpackInto(t testing.TB, b []byte) (root, outside string, err error) {
	base := t.TempDir()
	root, outside = filepath.Join(base, "root"), filepath.Join(base, "outside")
	for _, d := range []string{root, outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	r, err := os.OpenRoot(root)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	u := &unpacker{root: r, idBase: 1 << 30}
	return root, outside, u.run(context.Background(), bytes.NewReader(b))
}

func untouched(t testing.TB, outside string) {
	t.Helper()
	ents, err := os.ReadDir(outside)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		t.Fatalf("the unpacker wrote outside its root: %v", ents)
	}
	if _, err := os.Lstat(filepath.Join(filepath.Dir(outside), "planted")); err == nil {
		t.Fatal("the unpacker wrote beside its root")
	}
}

// TestUnpackerRefusesEscapes feeds the unpacker hostile streams directly
// (mutate.Extract drops most of them first; the unpacker must hold on its
// own).
func TestUnpackerRefusesEscapes(t *testing.T) {
	reg := func(name string) *tar.Header {
		return &tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}
	}
	cases := map[string]func(outside string) []*tar.Header{
		"through an absolute link": func(outside string) []*tar.Header {
			return []*tar.Header{{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: outside}, reg("evil/planted")}
		},
		"through a relative link": func(string) []*tar.Header {
			return []*tar.Header{{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: "../outside"}, reg("evil/planted")}
		},
		"dot-dot": func(string) []*tar.Header { return []*tar.Header{reg("../outside/planted")} },
		"dot-dot inside": func(string) []*tar.Header {
			return []*tar.Header{reg("a/../../outside/planted")}
		},
		"hard link to outside": func(string) []*tar.Header {
			return []*tar.Header{{Name: "h", Typeflag: tar.TypeLink, Linkname: "../outside/x"}}
		},
		"hard link through a link": func(outside string) []*tar.Header {
			if err := os.WriteFile(filepath.Join(outside, "x"), nil, 0o600); err != nil {
				t.Fatal(err)
			}
			defer os.Remove(filepath.Join(outside, "x"))
			return []*tar.Header{{Name: "l", Typeflag: tar.TypeSymlink, Linkname: outside}, {Name: "h", Typeflag: tar.TypeLink, Linkname: "l/x"}}
		},
		"file over a link": func(outside string) []*tar.Header {
			return []*tar.Header{{Name: "l", Typeflag: tar.TypeSymlink, Linkname: filepath.Join(outside, "planted")}, reg("l")}
		},
	}
	for what, mk := range cases {
		t.Run(what, func(t *testing.T) {
			base := t.TempDir()
			outside := filepath.Join(base, "outside")
			if err := os.Mkdir(outside, 0o755); err != nil {
				t.Fatal(err)
			}
			b := rawTar(t, mk(outside)...)
			root, out, err := unpackInto(t, b)
			t.Logf("unpack: %v", err)
			untouched(t, out)
			untouched(t, outside)
			_ = root
		})
	}
}

// FuzzUnpack: no stream, however made, writes outside the root.
func FuzzUnpack(f *testing.F) {
	f.Add(rawTar(f, &tar.Header{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: "../outside"}, &tar.Header{Name: "evil/x", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}))
	f.Add(rawTar(f, &tar.Header{Name: "a/b", Typeflag: tar.TypeReg, Mode: 0o4755, Size: 3}, &tar.Header{Name: "c", Typeflag: tar.TypeLink, Linkname: "a/b"}))
	f.Add(rawTar(f, &tar.Header{Name: "../x", Typeflag: tar.TypeReg, Size: 1}))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, outside, _ := unpackInto(t, b)
		untouched(t, outside)
	})
}
