package broker

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/rabbitnode"
)

// A testCA is a certificate authority made for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

func (ca *testCA) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// issue makes a certificate for cn signed by ca, for a server (with the
// loopback names) or a client, and returns it and its key in PEM.
func (ca *testCA) issue(t *testing.T, cn string, server bool) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.DNSNames = []string{"localhost"}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	require.NoError(t, err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}

// A RabbitMQ node of the test's own with a TLS listener only, a CA the
// test made, peer verification, and SASL EXTERNAL besides PLAIN: the
// client connects with the CA, is refused without it with an error that
// says why, authenticates by its certificate, and names its connections.
func TestRabbitMQTLS(t *testing.T) {
	dir := rabbitnode.Dir(t)
	ca := newTestCA(t, "rabbitmw test CA")
	serverCert, serverKey := ca.issue(t, "localhost", true)
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, data, 0o600))
		return p
	}
	conf := "ssl_options.cacertfile = " + write("ca.pem", ca.pem) + "\n" +
		"ssl_options.certfile = " + write("server.pem", serverCert) + "\n" +
		"ssl_options.keyfile = " + write("server.key", serverKey) + "\n" +
		"ssl_options.verify = verify_peer\n" +
		"ssl_options.fail_if_no_peer_cert = false\n" +
		"auth_mechanisms.1 = PLAIN\n" +
		"auth_mechanisms.2 = EXTERNAL\n" +
		"ssl_cert_login_from = common_name\n"
	node := rabbitnode.Start(t, dir, rabbitnode.Config{Name: "rmwtls", TLS: true, Conf: conf,
		Plugins: []string{"rabbitmq_auth_mechanism_ssl"}})

	var r [4]byte
	_, _ = rand.Read(r[:])
	user := "rmw-client-" + hex.EncodeToString(r[:])
	node.Ctl("add_user", user, hex.EncodeToString(r[:])+"-unused-password")
	node.Ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
	clientCert, clientKey := ca.issue(t, user, false)
	pair, err := tls.X509KeyPair(clientCert, clientKey)
	require.NoError(t, err)

	// use declares a queue, publishes to it and counts it on b.
	use := func(t *testing.T, b *Broker) error {
		ctx := testContext(t, 30*time.Second)
		q := queueName(t)
		top := Topology{Delays: testTiers}
		if err := b.Declare(ctx, q, top); err != nil {
			return err
		}
		require.NoError(t, b.Publish(ctx, "", q, amqp.Publishing{Body: []byte("x")}))
		n, err := b.Len(ctx, q)
		require.NoError(t, err)
		assert.Equal(t, 1, n)
		return nil
	}

	t.Run("with the CA", func(t *testing.T) {
		name := "rabbitmw-tls-test-" + hex.EncodeToString(r[:])
		b := New(node.URL(), Options{TLS: &tls.Config{RootCAs: ca.pool()}, ConnectionName: name, Process: "tls-test[1]"})
		defer b.Close()
		require.NoError(t, use(t, b))
		props := node.Ctl("list_connections", "client_properties", "user", "-q", "--no-table-headers")
		assert.Contains(t, props, `{"connection_name","`+name+` (tls-test[1])"}`)
	})

	t.Run("without the CA", func(t *testing.T) {
		b := New(node.URL(), Options{ReconnectMax: 50 * time.Millisecond})
		defer b.Close()
		ctx := testContext(t, 30*time.Second)
		start := time.Now()
		err := b.Declare(ctx, queueName(t), Topology{})
		require.ErrorIs(t, err, ErrCertificate)
		assert.Less(t, time.Since(start), 20*time.Second, "fatal at once, not retried until the deadline")
		assert.Contains(t, err.Error(), "Options.TLS")
		assert.Contains(t, err.Error(), "unknown authority")
	})

	t.Run("another server name", func(t *testing.T) {
		b := New(node.URL(), Options{TLS: &tls.Config{RootCAs: ca.pool(), ServerName: "rabbit.example"}})
		defer b.Close()
		err := b.Declare(testContext(t, 30*time.Second), queueName(t), Topology{})
		require.ErrorIs(t, err, ErrCertificate)
		assert.Contains(t, err.Error(), "rabbit.example")
	})

	t.Run("SASL EXTERNAL with the client certificate", func(t *testing.T) {
		url := strings.Replace(node.URL(), "guest:guest@", "", 1)
		b := New(url, Options{
			TLS:          &tls.Config{RootCAs: ca.pool(), Certificates: []tls.Certificate{pair}},
			ExternalAuth: true,
			Process:      "external-" + user,
		})
		defer b.Close()
		require.NoError(t, use(t, b))
		users := node.Ctl("list_connections", "user", "auth_mechanism", "client_properties", "-q", "--no-table-headers")
		found := false
		for _, line := range strings.Split(users, "\n") {
			if strings.Contains(line, "external-"+user) {
				found = true
				assert.True(t, strings.HasPrefix(line, user+"\tEXTERNAL\t"), "connection %q; want user %s by EXTERNAL", line, user)
			}
		}
		assert.True(t, found, "no connection of the broker in:\n%s", users)
	})

	t.Run("SASL EXTERNAL without a client certificate", func(t *testing.T) {
		b := New(node.URL(), Options{TLS: &tls.Config{RootCAs: ca.pool()}, ExternalAuth: true, ReconnectMax: 50 * time.Millisecond})
		defer b.Close()
		ctx := testContext(t, 30*time.Second)
		err := b.Declare(ctx, queueName(t), Topology{})
		require.ErrorIs(t, err, ErrAccessRefused)
		assert.Contains(t, err.Error(), "client certificate")
		assert.NoError(t, ctx.Err(), "fatal at once, not retried until the deadline")
	})
}

// A URL of amqp:// while Options.TLS or ExternalAuth is set would send the
// credentials unencrypted, or fail the handshake each time (EXTERNAL needs
// TLS): a typo in one URL of a cluster's list, found only when a
// reconnect happens to pick that node. It is refused at the first
// connection, whichever node that would have gone to, as a malformed URL
// is.
func TestPlainURLWithTLSRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		open func() *Broker
	}{
		{"New with Options.TLS", func() *Broker {
			return New("amqp://guest:guest@127.0.0.1:1/", Options{TLS: &tls.Config{}})
		}},
		{"New with ExternalAuth", func() *Broker {
			return New("amqp://127.0.0.1:1/", Options{ExternalAuth: true})
		}},
		{"one node of a cluster", func() *Broker {
			return NewCluster(Addresses{"amqps://guest:guest@127.0.0.1:1/", "amqp://guest:guest@127.0.0.1:2/", "amqps://guest:guest@127.0.0.1:3/"}, Options{TLS: &tls.Config{}})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := c.open()
			defer b.Close()
			ctx := testContext(t, 5*time.Second)
			err := b.Declare(ctx, queueName(t), Topology{})
			require.Error(t, err)
			assert.ErrorContains(t, err, "amqps://")
			assert.NotErrorIs(t, err, ErrUnreachable, "refused before any node was tried")
			assert.NoError(t, ctx.Err(), "refused at once, not retried until the deadline")
		})
	}
}
