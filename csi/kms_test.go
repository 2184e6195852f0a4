package csi

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
)

// A metadata KMS's sealed key opens with the same Secret and volume ID
// only; tampered, truncated or foreign metadata is refused, never
// mistaken for a key.
func TestMetadataKMSSealsPerVolume(t *testing.T) {
	k := metadataKMS("secret")
	pass, meta, err := k.newKey("vol-a")
	if err != nil || len(pass) != 28 || meta[metaDEK] == "" {
		t.Fatalf("new key %q, meta %v, %v", pass, meta, err)
	}
	if strings.Contains(meta[metaDEK], string(pass)) {
		t.Fatal("the stored key holds the passphrase in clear")
	}
	got, err := k.key("vol-a", meta)
	if err != nil || string(got) != string(pass) {
		t.Fatalf("unsealed %q, %v", got, err)
	}
	if _, err := metadataKMS("other").key("vol-a", meta); !errors.Is(err, errBadKey) {
		t.Fatalf("another Secret: %v", err)
	}
	if _, err := k.key("vol-b", meta); !errors.Is(err, errBadKey) {
		t.Fatalf("another volume's ID: %v", err)
	}
	var s sealedKey
	json.Unmarshal([]byte(meta[metaDEK]), &s)
	s.DEK[3] ^= 1
	tampered, _ := json.Marshal(s)
	s.DEK[3] ^= 1
	s.Nonce = s.Nonce[:5]
	short, _ := json.Marshal(s)
	for what, v := range map[string]string{
		"tampered": string(tampered), "short nonce": string(short),
		"truncated": meta[metaDEK][:len(meta[metaDEK])/2], "empty": "",
	} {
		if _, err := k.key("vol-a", map[string]string{metaDEK: v}); !errors.Is(err, errBadKey) {
			t.Errorf("%s metadata: %v", what, err)
		}
	}
	if _, err := k.key("vol-a", nil); err == nil || errors.Is(err, errBadKey) {
		t.Errorf("no metadata: %v", err)
	}
	// Sealed again for a clone: same passphrase, its own salt.
	cm, err := k.wrap("vol-c", pass)
	if err != nil || cm[metaDEK] == meta[metaDEK] {
		t.Fatal(err)
	}
	if got, err := k.key("vol-c", cm); err != nil || string(got) != string(pass) {
		t.Fatalf("clone's key: %v", err)
	}
}

func TestKeyManagerFor(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "config.json")
	os.WriteFile(conf, []byte(`{"meta":{"encryptionKMSType":"metadata"},
		"vault":{"encryptionKMSType":"vault","vaultAddress":"http://vault"},
		"secretname":{"encryptionKMSType":"metadata","secretName":"s"},
		"notype":{}}`), 0o600)
	sec := map[string]string{secretPassphraseKey: "pw"}
	if km, err := keyManagerFor(conf, "", sec); err != nil || km != secretKMS("pw") {
		t.Fatalf("default: %v %v", km, err)
	}
	if km, err := keyManagerFor(conf, "meta", sec); err != nil || km != metadataKMS("pw") {
		t.Fatalf("metadata: %v %v", km, err)
	}
	for _, c := range []struct {
		id, sub string
		sec     map[string]string
	}{
		{"", secretPassphraseKey, nil},
		{"meta", secretPassphraseKey, map[string]string{"userKey": "k"}},
		{"missing", "not in the KMS config", sec},
		{"vault", `"vault"`, sec},
		{"secretname", "secretName", sec},
		{"notype", "no encryptionKMSType", sec},
	} {
		_, err := keyManagerFor(conf, c.id, c.sec)
		wantCode(t, "KMS "+c.id, err, codes.InvalidArgument, c.sub)
	}
	_, err := keyManagerFor(filepath.Join(t.TempDir(), "none.json"), "meta", sec)
	wantCode(t, "no config file", err, codes.InvalidArgument, "no KMS config")
}
