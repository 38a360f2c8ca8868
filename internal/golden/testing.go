package golden

import (
	"testing"
)

// MustLoad is Load for tests.
func MustLoad(tb testing.TB, dir string) *Set {
	tb.Helper()
	s, err := Load(dir)
	if err != nil {
		tb.Fatalf("golden directory %s: %v", dir, err)
	}
	return s
}

// Bytes is Read for tests.
func (s *Set) Bytes(tb testing.TB, name string) []byte {
	tb.Helper()
	b, err := s.Read(name)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// Request holds a request body a client sent to a golden one: it must
// validate against the golden file's schema and match the golden body,
// the volatile members by type only.
func (s *Set) Request(tb testing.TB, what, name string, got []byte, volatile map[string]string) {
	tb.Helper()
	if err := s.Validate(s.SchemaOf(name), got); err != nil {
		tb.Errorf("%s: the request body breaks the specification's %s (golden %s):\n%v\nbody: %s", what, s.SchemaOf(name), name, err, got)
	}
	want := s.Bytes(tb, name)
	if err := Match(got, want, volatile); err != nil {
		tb.Errorf("%s: the request body differs from golden %s (%s):\n%v\nbody:   %s\ngolden: %s", what, name, s.Files[name].Source, err, got, want)
	}
}

// Response holds a response body a server sent to the shape of a golden
// one (Shape).
func (s *Set) Response(tb testing.TB, what, name string, got []byte) {
	tb.Helper()
	if err := s.Shape(name, got); err != nil {
		tb.Errorf("%s: the response body does not have the shape of golden %s (%s, %s):\n%v\nbody: %s", what, name, s.SchemaOf(name), s.Files[name].Source, err, got)
	}
}
